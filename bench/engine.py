"""Engine throughput against its limit: output tokens/s through `Engine.submit` next to a raw
loop that calls `llama_decode` on the same batch shapes with no scheduler at all.

    .venv/bin/python bench/engine.py [--tokens 64] [--repeats 3] [--concurrency 1 4 16]

Both sides use the same model, context parameters, prompts, prefill chunking and greedy C
sampler, and the same OS thread for llama.cpp calls (one OpenMP team: see ComputeThread in
engine/compute_thread.py), and run alternately in one process (these machines are noisy, so
only a side-by-side comparison means anything). The raw loop is the ceiling: any gap is
scheduler, channel and Trio overhead. Writes docs/benchmarks/engine.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import llama_cpp
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tributary import engine
from tributary.engine.compute_thread import compute_thread
from tributary.engine.runners.llama import (
    batch_tokens,
    default_model_path,
    load_model,
)

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "engine.json"
TOPICS = [
    "the history of Rome",
    "how bread is made",
    "the water cycle",
    "prime numbers",
    "the solar system",
    "how computers work",
    "the French revolution",
    "photosynthesis",
    "the stock market",
    "volcanoes",
    "classical music",
    "the human heart",
    "machine learning",
    "the ocean tides",
    "medieval castles",
    "honey bees",
]


def prompts(n: int) -> list[str]:
    return [f"Write a short essay about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def config(concurrency: int) -> engine.EngineConfig:
    return engine.EngineConfig(context_length=1024, max_running_requests=max(concurrency, 1))


# -- Tributary --------------------------------------------------------------------------


async def engine_run(eng: engine.Engine, texts: list[str], tokens: int) -> float:
    params = engine.SamplingParams.from_dict(
        {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
    )
    start = time.perf_counter()
    streams = [eng.submit(engine.GenerateRequest(text=t, sampling=params)) for t in texts]
    counts = [0] * len(texts)

    async def drain(i: int) -> None:
        async with streams[i] as stream:
            async for item in stream:
                counts[i] = item.completion_tokens  # type: ignore[union-attr]

    async with trio.open_nursery() as nursery:
        for i in range(len(texts)):
            nursery.start_soon(drain, i)
    elapsed = time.perf_counter() - start
    assert counts == [tokens] * len(texts), counts
    return sum(counts) / elapsed


# -- the raw loop -----------------------------------------------------------------------


class RawLoop:
    """llama.cpp with nothing around it: the same context, chunks and greedy sampling."""

    def __init__(self, cfg: engine.EngineConfig) -> None:
        self.model, _ = load_model(default_model_path(), cfg)  # weights paged as the engine's
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        assert cfg.context_length is not None
        self.chunk = cfg.prefill_chunk_tokens
        n_batch = batch_tokens(cfg)
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = cfg.kv_cells(cfg.context_length)
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = cfg.max_running_requests
        cp.n_threads = cp.n_threads_batch = os.cpu_count() or 1
        cp.kv_unified = False
        cp.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (llama_cpp.llama_token * (len(data) + 2))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, len(buf), True, True)
        return list(buf[:n])

    def run(self, texts: list[str], tokens: int) -> float:
        samplers = []
        for _ in texts:
            chain = llama_cpp.llama_sampler_chain_init(
                llama_cpp.llama_sampler_chain_default_params()
            )
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
            samplers.append(chain)
        start = time.perf_counter()
        ids = [self.tokenize(t) for t in texts]
        # Prefill in the scheduler's chunk sizes: (seq, pos, token) triples, chunk by chunk.
        todo = [(s, p, tok) for s, seq in enumerate(ids) for p, tok in enumerate(seq)]
        last = [None] * len(texts)
        for begin in range(0, len(todo), self.chunk):
            part = todo[begin : begin + self.chunk]
            outs = []
            for n, (s, p, tok) in enumerate(part):
                self._put(n, tok, p, s, p == len(ids[s]) - 1)
                if p == len(ids[s]) - 1:
                    outs.append((s, n))
            self.batch.n_tokens = len(part)
            assert llama_cpp.llama_decode(self.ctx, self.batch) == 0
            for s, n in outs:
                last[s] = llama_cpp.llama_sampler_sample(samplers[s], self.ctx, n)
        produced = len(texts)
        for step in range(tokens - 1):
            for s in range(len(texts)):
                self._put(s, last[s], len(ids[s]) + step, s, True)
            self.batch.n_tokens = len(texts)
            assert llama_cpp.llama_decode(self.ctx, self.batch) == 0
            for s in range(len(texts)):
                last[s] = llama_cpp.llama_sampler_sample(samplers[s], self.ctx, s)
            produced += len(texts)
        elapsed = time.perf_counter() - start
        for s, chain in enumerate(samplers):
            llama_cpp.llama_sampler_free(chain)
            llama_cpp.llama_memory_seq_rm(self.mem, s, -1, -1)
        return produced / elapsed

    def _put(self, n: int, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self.batch
        b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, pos, 1, logits
        b.seq_id[n][0] = seq

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


async def scheduler_overhead(concurrency: int, tokens: int = 256) -> float:
    """Microseconds of scheduler + channel + consumer work per step, with a sim runner whose
    steps cost nothing: everything measured is Tributary's own Python."""
    zero = engine.SimLatency(step_base=0.0, decode_per_seq=0.0, prefill_per_token=0.0)
    cfg = engine.EngineConfig(
        runner="sim", sim_latency=zero, max_running_requests=concurrency, context_length=4096
    )
    async with engine.open_engine(cfg) as eng:
        await engine_run(eng, prompts(concurrency), 8)
        before = eng.stats().steps
        start = time.perf_counter()
        await engine_run(eng, prompts(concurrency), tokens)
        elapsed = time.perf_counter() - start
        steps = eng.stats().steps - before
    return elapsed / steps * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()

    rows = []
    for c in args.concurrency:
        cfg = config(c)
        texts = prompts(c)
        compute = compute_thread()
        raw = await compute.run(RawLoop, cfg)
        eng_rates, stepwise_rates, raw_rates = [], [], []
        stepwise_cfg = dataclasses.replace(cfg, overlap_decode=False)
        async with engine.open_engine(cfg) as eng, engine.open_engine(stepwise_cfg) as stepwise:
            await engine_run(eng, texts, 4)  # warm-up all three
            await engine_run(stepwise, texts, 4)
            await compute.run(raw.run, texts, 4)
            for _ in range(args.repeats):
                eng_rates.append(await engine_run(eng, texts, args.tokens))
                stepwise_rates.append(await engine_run(stepwise, texts, args.tokens))
                raw_rates.append(await compute.run(raw.run, texts, args.tokens))
        await compute.run(raw.close)
        e, r = statistics.median(eng_rates), statistics.median(raw_rates)
        w = statistics.median(stepwise_rates)
        rows.append(
            {
                "concurrency": c,
                "engine_tokens_per_s": round(e, 1),
                "engine_no_overlap_tokens_per_s": round(w, 1),
                "raw_tokens_per_s": round(r, 1),
                "ratio": round(e / r, 3),
                "no_overlap_ratio": round(w / r, 3),
                "engine_runs": [round(x, 1) for x in eng_rates],
                "engine_no_overlap_runs": [round(x, 1) for x in stepwise_rates],
                "raw_runs": [round(x, 1) for x in raw_rates],
            }
        )
        overhead = await scheduler_overhead(c)
        rows[-1]["scheduler_overhead_us_per_step"] = round(overhead, 1)
        print(
            f"concurrency {c:>2}: engine {e:7.1f} tok/s (no overlap {w:7.1f})   raw {r:7.1f} "
            f"tok/s   ratio {e / r:.3f} ({w / r:.3f})   scheduler overhead {overhead:6.0f} us/step"
        )

    print()
    print(
        "| concurrency | engine tok/s | without overlap | raw llama_decode tok/s | engine / raw "
        "| without overlap / raw | scheduler overhead (us/step, sim) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['concurrency']} | {row['engine_tokens_per_s']} | "
            f"{row['engine_no_overlap_tokens_per_s']} | {row['raw_tokens_per_s']} | "
            f"{row['ratio']} | {row['no_overlap_ratio']} | "
            f"{row['scheduler_overhead_us_per_step']} |"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "benchmark": "engine throughput vs raw llama_decode loop",
                "model": default_model_path().name,
                "tokens_per_request": args.tokens,
                "repeats": args.repeats,
                "statistic": "median",
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {OUT.relative_to(Path.cwd()) if OUT.is_relative_to(Path.cwd()) else OUT}")


if __name__ == "__main__":
    trio.run(main)
