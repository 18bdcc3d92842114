"""Prefix reuse on the real model: how often mode "any" (a shared prefix reused at any token)
changes greedy output against a cold prefill, that mode "exact" never does, and what a
whole-prompt hit saves on a repeated prompt.

    .venv/bin/python bench/prefix_reuse.py [--rounds 3] [--tokens 32]

Divergence: a fixed corpus of 42 prompts, each a cut of one system prompt (24 tokens, under
a chunk; 90; 200; 270, just past one chunk; 400; 600; 1,100, mid-chunk after several) plus
one of six questions in chat markup (bench/prefix_cache.py's), in a fixed order. Each is
answered greedily (`ignore_eos`, `--tokens` tokens) three ways: cold (prefix cache off), then
on a fresh engine in mode "exact" and on one in mode "any", all prompts in the same order, so
that a prompt finds the earlier ones in the cache. Reported: how many prompts reused
something, how many answers differ from cold, and at which token the first difference comes.

Speed: prompts of several lengths asked twice, cold (after a flush) and then again (the whole
prompt restored: its KV and last logits row), in interleaved rounds; reported: time to first
token (median) and the prompt tokens not computed.

Writes docs/benchmarks/prefix-reuse.json and .md (notes between the markers are kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from page_notes import NOTES_END, NOTES_START, write_page
from prefix_cache import QUESTIONS, question, system_prompt
from serving_machine import cpu_facts

from tributary import engine
from tributary.engine.runners.llama import default_model_path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
OUT_JSON, OUT_MD = DOCS / "prefix-reuse.json", DOCS / "prefix-reuse.md"
CHUNK = 256
#: Shared prefix lengths (tokens): under a chunk, just past one, mid-chunk, several chunks.
PREFIXES = [24, 90, 200, 270, 400, 600, 1100]
#: Prompt lengths for the repeated-prompt timing.
REPEATED = [40, 300, 1000, 2000]


def corpus(eng: engine.Engine) -> list[tuple[int, list[int]]]:
    """(shared prefix length, prompt ids): each cut of one system prompt (a document) with
    each question, grouped by cut. Within a group prompts share the cut and the chat markup
    after it (a few tokens more); a group's first prompt shares the shorter cuts before it."""
    document = system_prompt(eng, max(PREFIXES))
    return [(n, document[:n] + question(eng, q)) for n in PREFIXES for q in range(len(QUESTIONS))]


def request(ids: list[int], tokens: int) -> engine.GenerateRequest:
    params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
    return engine.GenerateRequest(input_ids=ids, sampling=engine.SamplingParams.from_dict(params))


@dataclasses.dataclass
class Answer:
    ids: list[int]
    cached: int
    ttft: float


async def ask(eng: engine.Engine, ids: list[int], tokens: int) -> Answer:
    start = time.perf_counter()
    out: list[int] = []
    ttft = 0.0
    async with eng.submit(request(ids, tokens)) as stream:
        async for item in stream:
            assert not isinstance(item, engine.Error), item.error
            if item.output_ids and not ttft:
                ttft = time.perf_counter() - start
            out += item.output_ids
    assert isinstance(item, engine.Done)
    return Answer(out, item.cached_tokens, ttft)


#: llama.cpp threads (None: all cores); `--threads`.
THREADS: list[int | None] = [None]


def config(**fields: Any) -> engine.EngineConfig:
    return engine.EngineConfig(
        context_length=4096,
        max_running_requests=4,
        prefill_chunk_tokens=CHUNK,
        threads=THREADS[0],
        **fields,
    )


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


async def divergence(tokens: int) -> dict[str, Any]:
    answers: dict[str, list[Answer]] = {}
    modes = {
        "cold": config(prefix_cache_mb=0),
        "exact": config(prefix_reuse="exact"),
        "any": config(prefix_reuse="any"),
    }
    prompts: list[tuple[int, list[int]]] = []
    for name, cfg in modes.items():
        async with engine.open_engine(cfg) as eng:
            prompts = corpus(eng)
            answers[name] = []
            for _n, ids in prompts:
                answers[name].append(await ask(eng, ids, tokens))
                if len(answers[name]) % 7 == 0:
                    print(f"{name}: {len(answers[name])}/{len(prompts)} answered", flush=True)
    result: dict[str, Any] = {"prompts": len(prompts), "prefix_lengths": PREFIXES}
    for name in ("exact", "any"):
        hits = [i for i, a in enumerate(answers[name]) if a.cached]
        diffs = {i: first_difference(answers[name][i].ids, answers["cold"][i].ids) for i in hits}
        differing = {i: d for i, d in diffs.items() if d is not None}
        mid_chunk = [i for i in hits if answers[name][i].cached % CHUNK]
        result[name] = {
            "reused": len(hits),
            "reused_mid_chunk": len(mid_chunk),
            "cached_tokens_total": sum(a.cached for a in answers[name]),
            "differ": len(differing),
            "differ_mid_chunk": sum(1 for i in differing if i in mid_chunk),
            "first_difference_at": sorted(differing.values()),
            "differing_prompts": [
                {
                    "prefix": prompts[i][0],
                    "prompt_tokens": len(prompts[i][1]),
                    "cached": answers[name][i].cached,
                    "first_difference_at": d,
                }
                for i, d in sorted(differing.items())
            ],
        }
    return result


async def repeated(rounds: int, tokens: int) -> dict[str, Any]:
    """TTFT of a prompt asked cold and then again (a whole-prompt hit), per length."""
    runs: dict[int, dict[str, list[float]]] = {n: {"cold": [], "repeat": []} for n in REPEATED}
    cached: dict[int, int] = {}
    same: dict[int, bool] = {}
    async with engine.open_engine(config()) as eng:
        await ask(eng, system_prompt(eng, 32), 2)  # warm-up
        for r in range(rounds):
            for n in REPEATED:
                ids = system_prompt(eng, n)
                assert eng.flush_cache()
                cold = await ask(eng, ids, tokens)
                again = await ask(eng, ids, tokens)
                runs[n]["cold"].append(cold.ttft)
                runs[n]["repeat"].append(again.ttft)
                cached[n] = again.cached
                same[n] = same.get(n, True) and again.ids == cold.ids
            print(f"repeated round {r + 1}/{rounds}", flush=True)
    out = {}
    for n in REPEATED:
        cold, rep = statistics.median(runs[n]["cold"]), statistics.median(runs[n]["repeat"])
        out[str(n)] = {
            "cold_ttft_s": round(cold, 4),
            "repeat_ttft_s": round(rep, 4),
            "speedup": round(cold / rep, 1),
            "prompt_tokens_not_computed": cached[n],
            "same_tokens": same[n],
            "runs_s": {k: [round(x, 4) for x in v] for k, v in runs[n].items()},
        }
    return out


def machine() -> dict[str, Any]:
    import llama_cpp

    try:
        facts = cpu_facts(Path("/proc/cpuinfo").read_text())
    except OSError:
        facts = {"cpu": platform.processor() or "unknown", "isa": {}}
    return {
        "cpu": facts["cpu"],
        "isa": [k for k, v in facts["isa"].items() if v],
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads")
    args = parser.parse_args()
    THREADS[0] = args.threads
    div = await divergence(args.tokens)
    rep = await repeated(args.rounds, args.tokens)
    result = {
        "benchmark": "prefix reuse: exact vs any, whole-prompt hits",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "model": default_model_path().name,
        "chunk": CHUNK,
        "output_tokens": args.tokens,
        "rounds": args.rounds,
        "threads": args.threads or os.cpu_count(),
        "divergence": div,
        "repeated": rep,
        "machine": machine(),
        "command": "just bench-prefix-reuse " + " ".join(sys.argv[1:]),
    }
    write_page(result, markdown(result), OUT_JSON, OUT_MD, page)


def markdown(result: dict[str, Any]) -> str:
    div, rep = result["divergence"], result["repeated"]
    rows = [
        f"Divergence from a cold prefill ({div['prompts']} prompts, greedy, "
        f"{result['output_tokens']} tokens each):",
        "",
        "| mode | prompts reusing a prefix | of them mid-chunk | tokens reused | answers "
        "differing | first difference at token |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name in ("exact", "any"):
        d = div[name]
        at = ", ".join(map(str, d["first_difference_at"])) or "-"
        rows.append(
            f"| {name} | {d['reused']} | {d['reused_mid_chunk']} | "
            f"{d['cached_tokens_total']} | {d['differ']} | {at} |"
        )
    rows += [
        "",
        "Repeated prompt (asked cold, then again: the whole prompt restored), medians:",
        "",
        "| prompt tokens | TTFT cold | TTFT repeated | speedup | tokens not computed | "
        "same tokens |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for n, r in rep.items():
        rows.append(
            f"| {n} | {r['cold_ttft_s'] * 1000:.1f} ms | {r['repeat_ttft_s'] * 1000:.1f} ms | "
            f"{r['speedup']}x | {r['prompt_tokens_not_computed']} | {r['same_tokens']} |"
        )
    return "\n".join(rows)


def page(result: dict[str, Any], table: str, notes: str) -> str:
    m = result["machine"]
    return (
        "# Prefix reuse: exact and any\n\n"
        f"`{result['command']}` (bench/prefix_reuse.py), {result['date']}: "
        f"{result['model']}, prefill chunk {result['chunk']}, {result['threads']} llama.cpp "
        f"threads, {result['rounds']} rounds for the timings. Raw figures are in "
        "prefix-reuse.json.\n\n"
        f"{table}\n\n"
        f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, llama-cpp-python "
        f"{m['llama_cpp_python']}, load average at the end {m['load_average_at_end']}.\n\n"
        f"{NOTES_START}{notes or chr(10)}{NOTES_END}\n"
    )


if __name__ == "__main__":
    trio.run(main)
