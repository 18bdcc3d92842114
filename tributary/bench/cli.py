"""`tributary bench`: measure a serving endpoint over HTTP, as sglang.bench_serving does.

This module only defines the arguments at import time; the client (httpx, and matplotlib for
`--plot-dir`) is imported when a benchmark runs, so `tributary serve` needs neither.

Exit status: 0 when every measured request completed, 1 when any failed (the report, JSON and
plots are still written), 2 when the run could not start (bad flags, no tokenizer endpoint,
no server answering the model lookup).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import BenchConfig

__all__ = ["add_arguments", "config_from_args", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.splitlines()[0] if __doc__ else None
    target = p.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:30000")
    target.add_argument(
        "--backend",
        choices=["generate", "openai"],
        default="generate",
        help="generate: SGLang's native /generate; openai: /v1/completions or chat",
    )
    target.add_argument(
        "--endpoint",
        default=None,
        help="default /generate or /v1/completions; /v1/chat/completions for chat",
    )
    target.add_argument("--model", default=None, help="default: the first of /v1/models")
    target.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    target.add_argument("--label", default=None, help="this run's name in plots and reports")

    load = p.add_argument_group("workload")
    load.add_argument("--num-prompts", type=int, default=100)
    load.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    load.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    load.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="the first N prompt tokens are the same in every prompt",
    )
    load.add_argument("--seed", type=int, default=1, help="prompts and arrival times")
    load.add_argument(
        "--tokenizer-from",
        metavar="URL",
        default=None,
        help="build prompts with this server's /tokenize and /detokenize",
    )
    load.add_argument("--save-prompts", metavar="PATH", default=None)
    load.add_argument(
        "--load-prompts",
        metavar="PATH",
        default=None,
        help="the prompts --save-prompts wrote (same texts for every server of a comparison)",
    )
    load.add_argument(
        "--concurrency",
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (default: no limit)",
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: inf, all at once)",
    )
    load.add_argument(
        "--warmup",
        "--warmup-requests",
        type=int,
        default=1,
        help="requests sent first, with prompts of their own, and left out of every figure",
    )
    load.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (then output lengths vary)",
    )
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        metavar="JSON",
        help="merged into every request body",
    )
    load.add_argument(
        "--timeout", type=float, default=None, help="seconds before a request counts as failed"
    )

    out = p.add_argument_group("output")
    out.add_argument("--output-json", metavar="PATH", default=None)
    out.add_argument("--plot-dir", metavar="DIR", default=None, help="latency CDFs as PNG")
    out.add_argument("--no-progress", dest="progress", action="store_false")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from .config import BenchConfig

    return BenchConfig(
        base_url=args.base_url,
        backend=args.backend,
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        shared_prefix_len=args.shared_prefix_len,
        seed=args.seed,
        tokenizer_from=args.tokenizer_from,
        load_prompts=args.load_prompts,
        save_prompts=args.save_prompts,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        warmup=args.warmup,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=args.extra_body,
        timeout=args.timeout,
        label=args.label,
        progress=args.progress,
    )


def run(args: argparse.Namespace) -> int:
    try:
        import httpx
        import trio

        from .report import render_table, write_result
        from .runner import run_benchmark
        from .workload import WorkloadError
    except ImportError as exc:
        print(f"tributary bench: {exc}; install pip install 'tributary[bench]'", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"tributary bench: error: {exc}", file=sys.stderr)
        return 2
    failures: list[BaseException] = []
    try:
        result = trio.run(run_benchmark, config)
    except* (WorkloadError, httpx.HTTPError, OSError, ValueError) as group:
        failures.extend(group.exceptions)
    if failures:
        for failure in failures:
            print(f"tributary bench: error: {failure}", file=sys.stderr)
        return 2
    print(render_table(result), flush=True)
    if args.output_json:
        write_result(result, args.output_json)
    if args.plot_dir:
        from .plots import plot_latency_cdfs

        try:
            plot_latency_cdfs([result], args.plot_dir)
        except ImportError as exc:  # matplotlib, from the bench extra
            print(f"tributary bench: {exc}; no plots written", file=sys.stderr)
            return 2
    return 0 if result["failed"] == 0 else 1
