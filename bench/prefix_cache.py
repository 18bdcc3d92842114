"""KV reuse on the real model: time to first token with a shared 1,500-token prefix, cold
against warm (the prefix cache), and n = 4 samples forked from one prefill against four
prefills (today's expansion).

    .venv/bin/python bench/prefix_cache.py [--rounds 5] [--prefix-tokens 1500]

Every round runs each case once, alternating, in one process (these machines are shared and
noisy: only medians of interleaved rounds compare). Cases:

- cold, cache off: the prompt prefilled whole, with `prefix_cache_mb=0` (no snapshot taken;
  run before the cache-on cases in even rounds, after them in odd ones);
- cold: the same with the cache on, after a flush (pays one snapshot of the prefix's KV);
- warm: another question after the same prefix, whose chunk-aligned part is then restored;
- n = 4 forked / expanded: four seeded samples of one prompt (the prefix plus a question),
  submitted together as the HTTP layer does for `n`, with the cache off.

Writes docs/benchmarks/prefix-cache.json and .md (notes between the markers are kept).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from page_notes import NOTES_END, NOTES_START, write_page

from tributary import engine
from tributary.engine.compute_thread import compute_thread
from tributary.engine.runners.base import KVRestore
from tributary.engine.runners.llama import LlamaRunner, default_model_path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
OUT_JSON, OUT_MD = DOCS / "prefix-cache.json", DOCS / "prefix-cache.md"
QUESTIONS = [
    "Which shelf holds the lamp?",
    "What was moved on day 12?",
    "How many clocks are there?",
    "Which room had the vase?",
    "Summarize the notes in one line.",
    "What is on shelf 3?",
]


def system_prompt(eng: engine.Engine, n_tokens: int) -> list[int]:
    """n_tokens of varied text: the shared prefix (a long system prompt, say)."""
    words = ["book", "lamp", "clock", "vase", "map", "cup", "pen", "rug"]
    lines = [
        f"Note {i}: the {words[i % len(words)]} in room {i * 7 % 31} was moved to shelf "
        f"{i % 5} on day {i}."
        for i in range(n_tokens // 8)
    ]
    ids = eng.tokenize("<|im_start|>system\n" + "\n".join(lines))
    assert len(ids) >= n_tokens, "make the generated text longer"
    return ids[:n_tokens]


def question(eng: engine.Engine, i: int) -> list[int]:
    text = f"<|im_end|>\n<|im_start|>user\n{QUESTIONS[i % len(QUESTIONS)]}<|im_end|>\n"
    return eng.tokenize(text + "<|im_start|>assistant\n", add_special=False)


def request(ids: list[int], tokens: int, seed: int | None = None) -> engine.GenerateRequest:
    params: dict[str, object] = {"max_new_tokens": tokens, "ignore_eos": True}
    params.update(
        {"temperature": 0} if seed is None else {"temperature": 0.8, "sampling_seed": seed}
    )
    return engine.GenerateRequest(input_ids=ids, sampling=engine.SamplingParams.from_dict(params))


class Timed:
    """One request's times from submit: first token, last item; and its cached_tokens."""

    def __init__(self) -> None:
        self.ttft = 0.0
        self.total = 0.0
        self.cached = 0


async def run_together(eng: engine.Engine, reqs: list[engine.GenerateRequest]) -> list[Timed]:
    start = time.perf_counter()
    streams = [eng.submit(r) for r in reqs]
    timings = [Timed() for _ in reqs]

    async def drain(i: int) -> None:
        async with streams[i] as stream:
            async for item in stream:
                assert not isinstance(item, engine.Error), item.error
                if not timings[i].ttft and item.output_ids:
                    timings[i].ttft = time.perf_counter() - start
                if isinstance(item, engine.Done):
                    timings[i].total = time.perf_counter() - start
                    timings[i].cached = item.cached_tokens

    async with trio.open_nursery() as nursery:
        for i in range(len(reqs)):
            nursery.start_soon(drain, i)
    return timings


async def copy_costs(eng: engine.Engine, repeats: int = 5) -> tuple[float, float, int]:
    """Median seconds to restore the cached prefix into an empty slot and to snapshot it
    back, timed on the compute thread while the engine is idle (the engine's own calls)."""
    runner = eng._runner
    cache = eng._scheduler.prefix_cache
    assert isinstance(runner, LlamaRunner) and cache is not None and len(cache)
    state = next(iter(cache)).state

    def once() -> tuple[float, float]:
        start = time.perf_counter()
        runner._load(0, KVRestore(state, state.n_tokens))
        loaded = time.perf_counter()
        runner._snapshot(0)
        done = time.perf_counter()
        runner._free_slot(0)
        return loaded - start, done - loaded

    times = [await compute_thread().run(once) for _ in range(repeats)]
    return median([t[0] for t in times]), median([t[1] for t in times]), state.nbytes


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--n", type=int, default=4, help="samples per parallel-sampling request")
    args = parser.parse_args()

    def config(**fields: int | bool) -> engine.EngineConfig:
        slots = max(4, args.n)
        return engine.EngineConfig(context_length=4096, max_running_requests=slots, **fields)  # type: ignore[arg-type]

    cfg, off = config(), config(prefix_cache_mb=0)
    expanded_cfg = config(prefix_cache_mb=0, fork_parallel_samples=False)
    runs: dict[str, list[float]] = {
        k: []
        for k in (
            "cold_off_ttft",
            "cold_ttft",
            "warm_ttft",
            "forked_ttft",
            "forked_last_ttft",
            "forked_total",
            "expanded_ttft",
            "expanded_last_ttft",
            "expanded_total",
        )
    }
    cached: dict[str, int] = {}
    cache_bytes = entries = 0
    async with (
        engine.open_engine(cfg) as eng,
        engine.open_engine(off) as eng_off,
        engine.open_engine(expanded_cfg) as eng_expanded,
    ):
        prefix = system_prompt(eng, args.prefix_tokens)
        await run_together(eng_off, [request(prefix[:64], 2)])  # warm-up
        for r in range(args.rounds):
            q_cold, q_warm = question(eng, 2 * r), question(eng, 2 * r + 1)
            cold_prompt, warm_prompt = prefix + q_cold, prefix + q_warm

            # Cache off first in even rounds, last in odd ones: a drift in the machine's load
            # then does not always favour the same side.
            if r % 2 == 0:
                (t,) = await run_together(eng_off, [request(cold_prompt, args.tokens)])
                runs["cold_off_ttft"].append(t.ttft)
            assert eng.flush_cache()
            (t,) = await run_together(eng, [request(cold_prompt, args.tokens)])
            runs["cold_ttft"].append(t.ttft)
            cached["cold"] = t.cached
            (t,) = await run_together(eng, [request(warm_prompt, args.tokens)])
            runs["warm_ttft"].append(t.ttft)
            cached["warm"] = t.cached
            if r % 2 == 1:
                (t,) = await run_together(eng_off, [request(cold_prompt, args.tokens)])
                runs["cold_off_ttft"].append(t.ttft)
            stats = eng.stats()
            cache_bytes, entries = stats.prefix_cache_bytes, stats.prefix_cache_entries

            samples = [request(cold_prompt, args.tokens, seed=100 * r + i) for i in range(args.n)]
            for name, target in (("forked", eng_off), ("expanded", eng_expanded)):
                ts = await run_together(target, samples)
                runs[f"{name}_ttft"].append(min(t.ttft for t in ts))
                runs[f"{name}_last_ttft"].append(max(t.ttft for t in ts))
                runs[f"{name}_total"].append(max(t.total for t in ts))
            print(
                f"round {r + 1}/{args.rounds}: cold {runs['cold_ttft'][-1]:.2f} s "
                f"(cache off {runs['cold_off_ttft'][-1]:.2f} s), warm "
                f"{runs['warm_ttft'][-1]:.2f} s; n={args.n} forked "
                f"{runs['forked_total'][-1]:.2f} s, expanded {runs['expanded_total'][-1]:.2f} s",
                flush=True,
            )

        restore_s, snapshot_s, copied = await copy_costs(eng)
        prompt_tokens = len(prefix) + len(question(eng, 0))

    med = {k: round(median(v), 3) for k, v in runs.items()}
    result = {
        "benchmark": "prefix cache and forked parallel sampling",
        "model": default_model_path().name,
        "prefix_tokens": args.prefix_tokens,
        "prompt_tokens_about": prompt_tokens,
        "output_tokens": args.tokens,
        "n": args.n,
        "rounds": args.rounds,
        "statistic": "median",
        "cached_tokens": cached,
        "prefix_cache_bytes_after_warm": cache_bytes,
        "prefix_cache_entries_after_warm": entries,
        "median_s": med,
        "warm_speedup": round(med["cold_ttft"] / med["warm_ttft"], 2),
        "snapshot_cost_s": round(med["cold_ttft"] - med["cold_off_ttft"], 3),
        "copy_bytes": copied,
        "restore_ms": round(restore_s * 1000, 2),
        "snapshot_ms": round(snapshot_s * 1000, 2),
        "fork_ttft_speedup": round(med["expanded_last_ttft"] / med["forked_last_ttft"], 2),
        "fork_total_speedup": round(med["expanded_total"] / med["forked_total"], 2),
        "runs_s": {k: [round(x, 3) for x in v] for k, v in runs.items()},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "command": "just bench-prefix-cache " + " ".join(sys.argv[1:]),
    }
    write_page(result, markdown_table(result, med), OUT_JSON, OUT_MD, page)


def mib(n: object) -> str:
    assert isinstance(n, int)
    return f"{n / (1 << 20):.1f} MiB"


def markdown_table(result: dict[str, object], med: dict[str, float]) -> str:
    cached = result["cached_tokens"]
    assert isinstance(cached, dict)
    n = result["n"]
    rows = [
        "| case | median | |",
        "|---|---:|---|",
        f"| TTFT, cold, cache off | {med['cold_off_ttft']:.3f} s | whole prompt prefilled |",
        f"| TTFT, cold, cache on | {med['cold_ttft']:.3f} s | "
        f"also snapshots the prefix ({result['snapshot_cost_s']:+.3f} s) |",
        f"| TTFT, warm | {med['warm_ttft']:.3f} s | {cached.get('warm', 0)} tokens restored; "
        f"{result['warm_speedup']}x faster than cold |",
        f"| prefix cache held | {mib(result['prefix_cache_bytes_after_warm'])} | "
        f"{result['prefix_cache_entries_after_warm']} entry |",
        f"| restore / snapshot of the cached prefix | {result['restore_ms']} / "
        f"{result['snapshot_ms']} ms | {mib(result['copy_bytes'])} copied, on the compute "
        "thread |",
        f"| n={n} forked: first / last TTFT | {med['forked_ttft']:.3f} / "
        f"{med['forked_last_ttft']:.3f} s | one prefill, {n - 1} copies |",
        f"| n={n} expanded: first / last TTFT | {med['expanded_ttft']:.3f} / "
        f"{med['expanded_last_ttft']:.3f} s | {n} prefills |",
        f"| n={n} total, forked / expanded | {med['forked_total']:.3f} / "
        f"{med['expanded_total']:.3f} s | {result['fork_total_speedup']}x |",
    ]
    return "\n".join(rows)


def page(result: dict[str, object], table: str, notes: str) -> str:
    return (
        "# Prefix cache and forked parallel sampling\n\n"
        f"`{result['command']}` (bench/prefix_cache.py): {result['model']}, a "
        f"{result['prefix_tokens']}-token shared prefix plus a short question (about "
        f"{result['prompt_tokens_about']} prompt tokens), {result['output_tokens']} output "
        f"tokens, medians of {result['rounds']} interleaved rounds. Raw runs are in "
        "prefix-cache.json.\n\n"
        f"{table}\n\n"
        f"Machine: {result['machine']}.\n\n"
        f"{NOTES_START}{notes or chr(10)}{NOTES_END}\n"
    )


if __name__ == "__main__":
    trio.run(main)
