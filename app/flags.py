"""`tributary serve`'s flags: the parser (`build_parser`), and the engine, server and fleet
configurations they make (`configs`, `remote_config`). `cli.py` runs them."""

from __future__ import annotations

import argparse
from typing import Literal

from tributary import engine
from tributary.bench import cli as bench_cli
from tributary.engine import remote
from tributary.engine.placement import parse_gpu_layers, parse_tensor_split

from .chat.reasoning import REASONING_PARSER_NAMES
from .chat.template_check import read_template_file
from .chat.tool_parsers import TOOL_PARSER_NAMES
from .heap import GEN0_THRESHOLD
from .settings import ServerSettings

__all__ = ["build_parser", "configs", "parse_worker", "remote_config"]

#: `--repack-weights`' values as `EngineConfig.repack_weights` takes them.
REPACK_SETTINGS: dict[str, bool | Literal["auto"]] = {"auto": "auto", "on": True, "off": False}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tributary", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("serve", help="serve SGLang's /generate API over HTTP")
    defaults = engine.EngineConfig()
    http = ServerSettings()
    p.add_argument(
        "--model-path",
        "--model",
        default=None,
        metavar="NAME|PATH",
        help=f"a GGUF file, or a model shipped on PyPI by name: {', '.join(engine.MODELS)} "
        f"(default: {engine.DEFAULT_MODEL})",
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--chat-template-file", metavar="PATH", help="a jinja chat template to serve instead"
    )
    p.add_argument("--host", default=http.host)
    p.add_argument("--port", type=int, default=http.port, help="0 picks a free port")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=defaults.max_running_requests)
    p.add_argument("--max-queued-requests", type=int, default=defaults.max_queued_requests)
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=defaults.prefill_chunk_tokens,
        help="prompt tokens a prompt advances per step (its chunks' size)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        help="prompt tokens one step prefills, all prompts together "
        "(default: one chunk, --chunked-prefill-size)",
    )
    p.add_argument(
        "--burst-prefill-tokens",
        type=int,
        default=defaults.burst_prefill_tokens,
        help="requests admitted together decode once all have a first token, if their "
        "prompts hold at most this many tokens (default: %(default)s; 0: off)",
    )
    p.add_argument("--stream-interval", type=int, default=defaults.stream_interval)
    p.add_argument(
        "--incremental-streaming-output",
        "--stream-output",  # SGLang's deprecated spelling
        action="store_true",
        help="stream deltas instead of the cumulative text",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "f16", "q8_0"],
        default=defaults.kv_cache_dtype,
        help="KV cache element type (auto: f16; q8_0 takes about half the memory)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=defaults.prefix_cache_mb,
        help="host memory for reusable prompt prefixes' KV, in MiB (0 turns the cache off)",
    )
    p.add_argument(
        "--prefix-reuse",
        choices=["exact", "any"],
        default=defaults.prefix_reuse,
        help="exact: whole prompts and chunk-aligned prefixes (output never changes); "
        "any: also the longest shared prefix at any token (greedy output may differ slightly)",
    )
    p.add_argument(
        "--disable-parallel-sample-fork",
        action="store_true",
        help="prefill the prompt once per sample for n > 1 instead of once, then forking",
    )
    p.add_argument("--runner", choices=["llama", "sim"], default=defaults.runner)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all)")
    p.add_argument("--pooling", choices=["mean", "cls", "last"], help="default: the GGUF's")
    p.add_argument(
        "--embedding-context-length",
        type=int,
        default=defaults.embedding_context_length,
        metavar="TOKENS",
        help="the longest embedding input (its own KV cache; capped by the context length)",
    )
    gpu = p.add_argument_group("placement", "llama-server's flags; a CPU-only build ignores them")
    gpu.add_argument(
        "--n-gpu-layers", "-ngl", "--gpu-layers", default="auto", metavar="N|auto|all",
        help="layers on GPUs, the output layer first (default: auto, as many as fit)",
    )  # fmt: skip
    gpu.add_argument(
        "--main-gpu", "-mg", "--base-gpu-id", type=int, default=defaults.main_gpu,
        metavar="INDEX", help="the GPU for --split-mode none",
    )  # fmt: skip
    gpu.add_argument("--split-mode", "-sm", choices=["none", "layer", "row"], default="layer")
    gpu.add_argument(
        "--tensor-split", "-ts", default=None, metavar="N0,N1,...",
        help="each GPU's proportion of the layers, e.g. 3,1 (default: by free memory)",
    )  # fmt: skip
    gpu.add_argument(
        "--no-kv-offload", "-nkvo", action="store_true", help="keep the KV cache in host memory"
    )
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="decode each step only once the scheduler has planned it (no decoding ahead)",
    )
    p.add_argument(
        "--mmap",
        action="store_true",
        help="map the model file, as llama.cpp does by default, instead of reading the "
        "weights into memory in 2 MiB pages (a few percent slower a token)",
    )
    p.add_argument(
        "--repack-weights",
        choices=["auto", "on", "off"],
        default="auto",
        help="lay the weights out for llama.cpp's faster CPU kernels, as llama-server does "
        "(auto: unless llama.cpp was compiled with AMX, which crashes with them, the model has "
        "Q4_K weights, whose repacked kernels break batch invariance, or the CPU is not "
        "x86-64; on is refused with AMX)",
    )
    p.add_argument(
        "--no-repack",
        "-nr",
        dest="repack_weights",
        action="store_const",
        const="off",
        help="llama-server's spelling of --repack-weights off",
    )
    p.add_argument(
        "--max-run-decodes",
        type=int,
        default=defaults.max_run_decodes,
        help="decodes a step may chain while every request is simply decoding, without the "
        "scheduler in between (1: a step per token)",
    )
    p.add_argument(
        "--speculative-algorithm",
        choices=["NGRAM"],
        default=None,
        help="speculative decoding: NGRAM drafts tokens from n-grams of each request's prompt "
        "and output and verifies them in one batch (default: off)",
    )
    for name, help_text in (
        ("num_draft_tokens", "tokens drafted at most per verification"),
        ("ngram_min_match_window_size", "shortest suffix of a request's tokens a draft matches"),
        ("ngram_max_match_window_size", "longest suffix of a request's tokens a draft matches"),
        ("disable_by_batch_size", "no drafts while more requests than this run (0: no limit)"),
    ):
        field = f"speculative_{name}"
        p.add_argument(
            "--" + field.replace("_", "-"),
            type=int,
            default=getattr(defaults, field),
            help=help_text,
        )
    p.add_argument(
        "--enable-custom-logit-processor",
        action="store_true",
        help="accept SGLang custom logit processors (runs Python code that clients send); "
        "at a front (--worker-url), forward them to the workers instead of refusing them",
    )
    p.add_argument("--weight-version", default=http.weight_version)
    p.add_argument("--graceful-timeout", type=float, default=http.graceful_timeout)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may take; past it a 408 (default: no limit)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=http.max_request_bytes,
        help="largest request body accepted; larger ones get a 413",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=http.max_logprobs,
        help="most logprob alternatives per position (top_logprobs_num, /v1 logprobs); "
        "more is a 400",
    )
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    p.add_argument(
        "--admin-api-key",
        default=None,
        help="the key that /abort_request and /flush_cache need (--api-key no longer opens "
        "them); at a front, the one key that lists, adds and removes workers (without it, "
        "worker management is off)",
    )
    p.add_argument(
        "--log-level", default=http.log_level, choices=["debug", "info", "warning", "error"]
    )
    p.add_argument(
        "--log-format",
        default=http.log_format,
        choices=["text", "json"],
        help="json: one JSON object per log line (access lines carry their fields)",
    )
    p.add_argument(
        "--log-requests",
        action="store_true",
        help="put each request's prompt in its access log line (off: prompts are never logged)",
    )
    p.add_argument("--disable-metrics", action="store_true", help="no GET /metrics")
    # How chat output is read for tool calls and reasoning_content (SGLang's names).
    p.add_argument("--tool-call-parser", choices=TOOL_PARSER_NAMES, default=None)
    p.add_argument("--reasoning-parser", choices=REASONING_PARSER_NAMES, default=None)
    p.add_argument(
        "--enable-metrics",
        action="store_true",
        help="accepted for SGLang command lines; metrics are on unless --disable-metrics",
    )
    p.add_argument(
        "--gc-threshold",
        type=int,
        default=GEN0_THRESHOLD,
        help="once serving, freeze the start-up heap and collect Python's youngest "
        "generation after this many allocations (CPython's default: 700); "
        "0 leaves the collector as it is",
    )
    p.add_argument(
        "--enable-request-timing",
        action="store_true",
        help="terminal meta_info (and /v1 `timings`) carry time to first token, queue, "
        "prefill and decode time",
    )
    fleet = p.add_argument_group(
        "serving from workers",
        "forward generation to SGLang, vLLM or Tributary workers "
        "instead of loading a model (docs/scale-out.md)",
    )
    fleet.add_argument(
        "--worker-url",
        action="append",
        default=[],
        metavar="URL",
        help="a worker's base URL (repeat for more); URL#openai sets its kind",
    )
    fleet.add_argument(
        "--workers-file",
        default=None,
        metavar="PATH",
        help="one worker a line: URL, URL#KIND or KIND URL; # starts a comment",
    )
    fleet.add_argument(
        "--worker-kind",
        choices=["sglang", "openai"],
        default="sglang",
        help="the kind of workers that do not say (sglang: POST /generate; openai: "
        "POST /v1/completions, for vLLM and llama.cpp's server)",
    )
    fleet.add_argument("--policy", choices=list(remote.POLICIES), default="cache_aware")
    fleet.add_argument(
        "--health-check-interval",
        type=float,
        default=remote.RemoteConfig().health_check_interval,
        help="seconds between /health probes of each worker (0: none)",
    )
    fleet.add_argument(
        "--max-retries",
        type=int,
        default=remote.RemoteConfig().max_retries,
        help="retries on another worker for a request that failed before its first output",
    )
    fleet.add_argument(
        "--worker-timeout",
        type=float,
        default=remote.RemoteConfig().worker_timeout,
        metavar="SECONDS",
        help="the longest a worker may stay silent once it has a request (for its answer's "
        "headers, then between two chunks of it); past it a 504, not retried",
    )
    fleet.add_argument(
        "--max-worker-answer-bytes",
        type=int,
        default=remote.RemoteConfig().max_answer_bytes,
        metavar="BYTES",
        help="largest worker answer the front holds whole (a unary chat completion); past it a 502",
    )
    bench_cli.add_arguments(
        commands.add_parser("bench", help="benchmark a server over HTTP (see docs/benchmarks)")
    )
    return parser


def configs(args: argparse.Namespace) -> tuple[engine.EngineConfig, ServerSettings]:
    engine_config = engine.EngineConfig(
        runner=args.runner,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        chat_template=read_template_file(args.chat_template_file),
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        prefill_chunk_tokens=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        burst_prefill_tokens=args.burst_prefill_tokens,
        stream_interval=args.stream_interval,
        threads=args.threads,
        n_gpu_layers=parse_gpu_layers(args.n_gpu_layers),  # type: ignore[arg-type]
        main_gpu=args.main_gpu,
        split_mode=args.split_mode,
        tensor_split=parse_tensor_split(args.tensor_split) if args.tensor_split else (),
        kv_offload=not args.no_kv_offload,
        enable_custom_logit_processor=args.enable_custom_logit_processor,
        overlap_decode=not args.disable_overlap_schedule,
        max_run_decodes=args.max_run_decodes,
        speculative_algorithm=args.speculative_algorithm,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        speculative_ngram_min_match_window_size=args.speculative_ngram_min_match_window_size,
        speculative_ngram_max_match_window_size=args.speculative_ngram_max_match_window_size,
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
        mmap_weights=args.mmap,
        repack_weights=REPACK_SETTINGS[args.repack_weights],
        kv_cache_dtype=args.kv_cache_dtype,
        prefix_cache_mb=args.prefix_cache_mb,
        prefix_reuse=args.prefix_reuse,
        fork_parallel_samples=not args.disable_parallel_sample_fork,
        pooling=args.pooling,
        embedding_context_length=args.embedding_context_length,
    )
    if args.admin_api_key is not None and args.admin_api_key == args.api_key:
        # Every holder of the API key would be an admin: abort anyone's requests, flush the
        # cache and, at a front, add workers that then receive other users' prompts.
        raise ValueError(
            "--admin-api-key must differ from --api-key: with the same key every user is an "
            "admin (aborts, cache flushes, adding and removing workers)"
        )
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        incremental_streaming_output=args.incremental_streaming_output,
        weight_version=args.weight_version,
        graceful_timeout=args.graceful_timeout,
        request_timeout=args.request_timeout,
        max_request_bytes=args.max_request_bytes,
        max_logprobs=args.max_logprobs,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        log_level=args.log_level,
        log_format=args.log_format,
        log_requests=args.log_requests,
        enable_metrics=not args.disable_metrics,
        enable_request_timing=args.enable_request_timing,
    )
    return engine_config, settings


def remote_config(args: argparse.Namespace) -> remote.RemoteConfig | None:
    """The fleet the flags name, or None (serve a model of our own). ValueError for a
    worker line or kind that makes no sense."""
    lines = list(args.worker_url)
    if args.workers_file is not None:
        with open(args.workers_file, encoding="utf-8") as file:
            lines += [line.split(" #")[0].strip() for line in file]
    workers = [parse_worker(line, args.worker_kind) for line in lines if line and line[0] != "#"]
    if not workers:
        if args.workers_file is not None:
            # Serving a model of our own instead would be a surprise (and load a model).
            raise ValueError(f"--workers-file {args.workers_file} names no worker")
        return None
    if args.max_retries < 0:
        raise ValueError(f"--max-retries must be at least 0, got {args.max_retries}")
    if not args.worker_timeout > 0:
        raise ValueError(f"--worker-timeout must be a positive number, got {args.worker_timeout}")
    if args.max_worker_answer_bytes < 1:
        raise ValueError(
            f"--max-worker-answer-bytes must be at least 1, got {args.max_worker_answer_bytes}"
        )
    return remote.RemoteConfig(
        workers=tuple(workers),
        policy=args.policy,
        served_model_name=args.served_model_name,
        max_retries=args.max_retries,
        health_check_interval=args.health_check_interval,
        worker_timeout=args.worker_timeout,
        max_answer_bytes=args.max_worker_answer_bytes,
        enable_custom_logit_processor=args.enable_custom_logit_processor,
    )


def parse_worker(line: str, default_kind: str) -> tuple[str, remote.WorkerKind]:
    """`URL`, `URL#KIND` or `KIND URL` -> (URL, KIND)."""
    parts = line.split()
    if len(parts) == 2:
        kind, url = parts
    elif len(parts) == 1:
        url, _, kind = parts[0].partition("#")
        kind = kind or default_kind
    else:
        raise ValueError(f"a worker is URL, URL#KIND or KIND URL, got {line!r}")
    if kind not in ("sglang", "openai"):
        raise ValueError(f"a worker's kind is sglang or openai, got {kind!r} in {line!r}")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"a worker URL starts with http:// or https://, got {url!r}")
    return url.rstrip("/"), kind  # type: ignore[return-value]
