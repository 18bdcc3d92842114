"""N-gram speculative decoding on a fixed corpus: how often greedy output differs from plain
decoding, how many drafts are accepted, and the tokens/s it gains at concurrency 1.

    just bench-speculative            # or: .venv/bin/python bench/speculative.py --rounds 3

One engine in-process (SmolLM2-135M, `--speculative-algorithm NGRAM`), one request at a time.
Each prompt is generated with speculation on and off (the per-request
`speculative_num_draft_tokens: 0`, which is what a server without speculation runs: decode
runs and all), the order alternating every round. Greedy, so the two outputs should be equal;
where they are not, the first differing token is reported (verification computes a batch of
k + 1 positions, whose logits may differ from one-token decodes in their last bits).

Corpus: two code snippets of about 300 tokens to reproduce with one identifier renamed
(bench/repetitive), an extraction from a document, a quotation, and three ordinary prompts.
Decode tokens/s is (tokens - 1) / (time from the first token to the last). Writes
docs/benchmarks/speculative.md and .json, with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import trio

from tributary import engine
from tributary.engine import EngineConfig, Frame, GenerateRequest, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks" / "speculative"
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

MEMO = (
    "Subject: Warehouse move\n\n"
    "The lease on the Dalton Street warehouse ends on 30 June. Facilities has signed for the "
    "new site at 14 Harbor Road, which will be ready on 12 June. Movers are booked for 13 and "
    "14 June at a cost of 18,400 euros. Shelving for the new site costs 6,250 euros and arrives "
    "on 10 June. The IT team will move the servers on the weekend of 15 June; expect the order "
    "system to be down for six hours that Saturday. Staff parking at Harbor Road costs 40 euros "
    "a month per car, paid by the company for the first year. Questions go to Maria Okafor in "
    "Facilities."
)
POEM = (
    "The river bends below the hill,\nthe mill wheel turns, the air is still.\n"
    "A heron waits beside the reeds,\nand watches where the current leads.\n\n"
    "The evening comes in shades of grey,\nthe fishing boats have gone away.\n"
    "A lamp is lit in every door,\nand no one walks along the shore."
)
ORDINARY = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "What are three good habits for staying healthy? Explain each briefly.",
]


def corpus() -> list[tuple[str, str, str]]:
    """(name, kind, prompt) for each prompt."""
    tasks = json.loads((ROOT / "bench" / "repetitive" / "tasks.json").read_text())
    prompts = []
    for snippet, new in zip(tasks["snippets"][:2], ("entries", "bucket"), strict=True):
        code = (ROOT / "bench" / "repetitive" / snippet["file"]).read_text()
        old = snippet["rename"][0]
        ask = tasks["instruction"].format(old=old, new=new) + "\n\n" + code
        prompts.append((f"code:{snippet['file'].split('.')[0]}", "repetitive", CHAT.format(ask)))
    prompts.append(
        (
            "extract:memo",
            "repetitive",
            CHAT.format(MEMO + "\n\nList every date in the memo above with what happens on it."),
        )
    )
    prompts.append(
        (
            "quote:poem",
            "repetitive",
            CHAT.format(POEM + "\n\nQuote the second stanza of this poem exactly."),
        )
    )
    for i, question in enumerate(ORDINARY):
        prompts.append((f"ordinary:{i + 1}", "ordinary", CHAT.format(question)))
    return prompts


async def generate(eng: engine.Engine, prompt: str, *, spec: bool, tokens: int) -> dict[str, Any]:
    params: dict[str, Any] = {"temperature": 0, "max_new_tokens": tokens}
    if not spec:
        params["speculative_num_draft_tokens"] = 0
    req = GenerateRequest(text=prompt, sampling=SamplingParams.from_dict(params))
    ids: list[int] = []
    first = None
    steps = eng.stats().steps
    async with eng.submit(req) as stream:
        async for item in stream:
            assert not isinstance(item, engine.Error), item.error
            if first is None and item.output_ids:
                first = time.perf_counter()
            ids += item.output_ids
            if not isinstance(item, Frame):
                done = item
    end = time.perf_counter()
    steps = eng.stats().steps - steps
    assert isinstance(done, engine.Done) and first is not None
    counts = done.speculative
    return {
        "ids": ids,
        "decode_tps": (len(ids) - 1) / (end - first) if end > first and len(ids) > 1 else None,
        "drafted": counts.draft_tokens if counts else 0,
        "accepted": counts.accepted_tokens if counts else 0,
        "verifies": counts.verify_ct if counts else 0,
        "steps": steps,  # forward passes, one request at a time (a run's decodes count one each)
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(
        context_length=2048,
        max_running_requests=4,
        threads=args.threads,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=args.draft,
    )
    prompts = corpus()
    results: dict[str, dict[str, Any]] = {
        name: {"kind": kind, "on": [], "off": [], "diverged_at": []} for name, kind, _ in prompts
    }
    async with engine.open_engine(config) as eng:
        await generate(eng, prompts[0][2], spec=False, tokens=8)  # warm-up
        for r in range(args.rounds):
            for name, _kind, prompt in prompts:
                order = (True, False) if r % 2 == 0 else (False, True)
                got = {}
                for spec in order:
                    got[spec] = await generate(eng, prompt, spec=spec, tokens=args.tokens)
                on, off = got[True], got[False]
                diverged = next(
                    (
                        i
                        for i, (a, b) in enumerate(zip(on["ids"], off["ids"], strict=False))
                        if a != b
                    ),
                    None
                    if len(on["ids"]) == len(off["ids"])
                    else min(len(on["ids"]), len(off["ids"])),
                )
                entry = results[name]
                entry["diverged_at"].append(diverged)
                entry["on"].append(
                    {k: v for k, v in on.items() if k != "ids"} | {"n": len(on["ids"])}
                )
                entry["off"].append(
                    {k: v for k, v in off.items() if k != "ids"} | {"n": len(off["ids"])}
                )
                print(name, "round", r + 1, summary_line(entry), flush=True)
    return {"prompts": results}


def summary_line(entry: dict[str, Any]) -> str:
    s = summarize(entry)
    return (
        f"accept {s['accept_rate']:.2f} speedup {s['speedup']:.2f} "
        f"diverged {s['diverged_rounds']}/{s['rounds']}"
    )


def summarize(entry: dict[str, Any]) -> dict[str, Any]:
    on, off = entry["on"], entry["off"]
    drafted = sum(x["drafted"] for x in on)
    accepted = sum(x["accepted"] for x in on)
    on_tps = statistics.median(x["decode_tps"] for x in on if x["decode_tps"])
    off_tps = statistics.median(x["decode_tps"] for x in off if x["decode_tps"])
    diverged = [d for d in entry["diverged_at"] if d is not None]
    on_steps = sum(x["steps"] for x in on) / sum(x["n"] for x in on)
    off_steps = sum(x["steps"] for x in off) / sum(x["n"] for x in off)
    return {
        "rounds": len(on),
        "tokens": statistics.median(x["n"] for x in on),
        "drafted": drafted,
        "accepted": accepted,
        "accept_rate": accepted / drafted if drafted else 0.0,
        "on_tps": on_tps,
        "off_tps": off_tps,
        "speedup": on_tps / off_tps,
        "on_steps_per_token": on_steps,
        "off_steps_per_token": off_steps,
        "diverged_rounds": len(diverged),
        "diverged_at": diverged,
    }


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    import llama_cpp

    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
    }


def write(report: dict[str, Any], args: argparse.Namespace) -> None:
    rows = {name: summarize(entry) for name, entry in report["prompts"].items()}
    report["summary"] = rows
    OUT.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    m = report["machine"]
    lines = [
        "# N-gram speculative decoding",
        "",
        f"`just bench-speculative` ({time.strftime('%Y-%m-%d')}): SmolLM2-135M Q4_1, "
        f"{args.threads} threads, one request at a time, greedy, {args.tokens} new tokens, "
        f"`--speculative-num-draft-tokens {args.draft}`, {args.rounds} rounds, speculation on "
        "and off alternating (off: the request's `speculative_num_draft_tokens: 0`).",
        "",
        f"Machine: {m['cpu']}, {m['cpus']} CPUs, {m['platform']}, llama-cpp-python "
        f"{m['llama_cpp_python']}; 1-minute load average {m['load_average'][0]:.1f} at the start, "
        f"{m['load_average'][1]:.1f} at the end. "
        "Raw figures: [speculative.json](speculative.json).",
        "",
        "Steps/token: forward passes per output token with speculation on (off: 1.00, a decode "
        "run's decodes counting one each; a verification step decodes up to k + 1 positions). "
        "Decode tok/s is wall-clock from the first token to the last, median of the rounds; "
        "speedup is on over off. On a machine shared with other work (a load average above its "
        "CPU count) wall-clock figures swing by several times between requests, and only the "
        "steps, the acceptance and the divergence are to be trusted.",
        "",
        "| Prompt | Kind | Tokens | Drafted | Accepted | Accept rate | Steps/token on | "
        "Decode tok/s off | on | Speedup | Greedy output differs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in rows.items():
        where = ", ".join(f"token {d}" for d in s["diverged_at"]) or "no"
        lines.append(
            f"| {name} | {report['prompts'][name]['kind']} | {s['tokens']:.0f} | {s['drafted']} "
            f"| {s['accepted']} | {s['accept_rate']:.2f} | {s['on_steps_per_token']:.2f} | "
            f"{s['off_tps']:.1f} | "
            f"{s['on_tps']:.1f} | {s['speedup']:.2f} | {where} "
            f"({s['diverged_rounds']}/{s['rounds']}) |"
        )
    for kind in ("repetitive", "ordinary"):
        speedups = [s["speedup"] for n, s in rows.items() if report["prompts"][n]["kind"] == kind]
        lines.append("")
        lines.append(f"Median speedup, {kind} prompts: {statistics.median(speedups):.2f}.")
    diverged = sum(s["diverged_rounds"] for s in rows.values())
    total = sum(s["rounds"] for s in rows.values())
    lines += ["", f"Greedy outputs that differ from plain decoding: {diverged} of {total}.", ""]
    OUT.with_suffix(".md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--draft", type=int, default=8, help="--speculative-num-draft-tokens")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    report = trio.run(run, args)
    report["machine"] = machine() | {"load_average": [load, os.getloadavg()[0]]}
    report["settings"] = vars(args)
    write(report, args)
    print(OUT.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
