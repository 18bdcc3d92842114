"""The figures of a run: a flat JSON document (`--output-json`) and the table printed at the end.

Names follow `sglang.bench_serving` (`output_throughput`, `median_ttft_ms`, `p99_itl_ms`, ...)
so one script can read either tool's results. Definitions, over completed requests only:

- duration: from the first measured request sent to the last one finished (warm-up excluded)
- request/input/output/total throughput: completed requests, their prompt tokens (the
  server's count when it reports one), output tokens, and the sum of both, per second
- TTFT: request sent to first output text; ITL: the gaps between content chunks;
  TPOT: (e2e - TTFT) / (output tokens - 1), for requests of more than one token;
  e2e: request sent to the end of the stream
- concurrency: the sum of e2e latencies over the duration (mean requests in flight)
- server_e2e: with the `generate` backend, client e2e against `meta_info.e2e_latency`
- client_cpu_time, client_cpu_load: the CPU this process spent during the measured requests,
  in seconds and as a share of one core over the duration; near 1 the client, not the
  server, sets the pace

Every failed request is counted (`failed`), its reason tallied (`failure_reasons`) and kept in
`requests`; figures of failed requests are not mixed into the latency statistics.
"""

from __future__ import annotations

import datetime
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .backends import Backend
from .streams import RequestRecord
from .workload import Workload

if TYPE_CHECKING:
    from .config import BenchConfig

__all__ = [
    "METRICS",
    "STATISTICS",
    "Result",
    "load_result",
    "render_table",
    "summarize",
    "write_result",
]

#: A run's result: the JSON document, keys as docs/benchmarks/client.md lists them.
Result = dict[str, Any]

#: Latency metrics, each reported in ms with every statistic: `mean_ttft_ms`, `p99_itl_ms`, ...
METRICS = ("ttft", "tpot", "itl", "e2e_latency")
STATISTICS = ("mean", "median", "std", "p90", "p95", "p99")

#: Version of the JSON document's layout.
FORMAT = 1


def summarize(
    config: BenchConfig,
    backend: Backend,
    workload: Workload,
    records: Sequence[RequestRecord],
    *,
    duration: float,
    started_at: datetime.datetime,
    warmup_records: Sequence[RequestRecord],
    run_start: float,
    client_cpu: float,
) -> Result:
    done = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    e2e = [r.e2e_latency for r in done if r.e2e_latency is not None]
    latencies = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [
            (r.e2e_latency - r.ttft) / (r.output_tokens - 1)
            for r in done
            if r.output_tokens > 1 and r.e2e_latency is not None and r.ttft is not None
        ],
        "itl": [gap for r in done for gap in r.itl],
        "e2e_latency": e2e,
    }
    result: Result = {
        "tributary_bench": FORMAT,
        "label": config.label or f"{backend.kind} {backend.base_url}",
        "backend": backend.kind,
        "base_url": backend.base_url,
        "endpoint": backend.endpoint,
        "model": backend.model,
        "date": started_at.isoformat(timespec="seconds"),
        "num_prompts": len(records),
        "input_len": workload.spec.input_len,
        "output_len": backend.output_len,
        "shared_prefix_len": workload.spec.shared_prefix_len,
        "seed": workload.spec.seed,
        "tokenizer_url": workload.tokenizer_url,
        "request_rate": None if math.isinf(config.request_rate) else config.request_rate,
        "max_concurrency": config.concurrency,
        "ignore_eos": backend.ignore_eos,
        "temperature": backend.temperature,
        "warmup": len(warmup_records),
        "warmup_failed": sum(not r.ok for r in warmup_records),
        "warmup_failure_reasons": _reasons(warmup_records),
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "failure_reasons": _reasons(records),
        # Resent on a new connection after a kept-alive one was found closed (counted, and
        # their time includes the failed attempt).
        "retried": sum(r.retries for r in records),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "output_tokens_source": dict(Counter(r.output_tokens_source for r in done)),
        "request_throughput": len(done) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "concurrency": sum(e2e) / duration,
        "client_cpu_time": client_cpu,
        "client_cpu_load": client_cpu / duration,
    }
    for metric in METRICS:
        result.update(_statistics(metric, latencies[metric]))
    result["max_itl_ms"] = max(latencies["itl"]) * 1000 if latencies["itl"] else None
    result["server_e2e"] = _server_e2e(done)
    result["requests"] = [_request(r, run_start) for r in records]
    return result


def _statistics(metric: str, seconds: Sequence[float]) -> dict[str, float | None]:
    if not seconds:
        return {f"{stat}_{metric}_ms": None for stat in STATISTICS}
    ms = np.asarray(seconds) * 1000
    values = {
        "mean": ms.mean(),
        "median": np.median(ms),
        "std": ms.std(),
        "p90": np.percentile(ms, 90),
        "p95": np.percentile(ms, 95),
        "p99": np.percentile(ms, 99),
    }
    return {f"{stat}_{metric}_ms": float(values[stat]) for stat in STATISTICS}


def _server_e2e(done: Iterable[RequestRecord]) -> dict[str, float | None] | None:
    pairs = [
        (r.e2e_latency, r.server_e2e_latency)
        for r in done
        if r.e2e_latency is not None and r.server_e2e_latency is not None
    ]
    if not pairs:
        return None
    client, server = (np.asarray(side) * 1000 for side in zip(*pairs, strict=True))
    return {
        "count": len(pairs),
        "mean_client_ms": float(client.mean()),
        "mean_server_ms": float(server.mean()),
        "mean_diff_ms": float((client - server).mean()),
        "median_diff_ms": float(np.median(client - server)),
        "ratio": float(client.mean() / server.mean()) if server.mean() > 0 else None,
    }


def _reasons(records: Iterable[RequestRecord]) -> dict[str, int]:
    return dict(Counter(r.error or "unknown" for r in records if not r.ok).most_common())


def _request(r: RequestRecord, run_start: float) -> dict[str, Any]:
    return {
        "index": r.index,
        "ok": r.ok,
        "error": r.error,
        "start": r.start - run_start if r.start else None,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "output_tokens_source": r.output_tokens_source,
        "ttft": r.ttft,
        "e2e_latency": r.e2e_latency,
        "server_e2e_latency": r.server_e2e_latency,
        "retries": r.retries,
        "itl": r.itl,
    }


def load_result(path: str | Path) -> Result:
    result: Result = json.loads(Path(path).read_text())
    return result


def write_result(result: Result, path: str | Path) -> None:
    """Indented figures, then one line per request (their ITL lists would fill pages)."""
    head = json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=1)
    requests = ",\n  ".join(json.dumps(r) for r in result["requests"])
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f'{head[:-2]},\n "requests": [\n  {requests}\n ]\n}}\n')


def render_table(result: Result) -> str:
    """The report printed at the end of a run, as plain fixed-width text."""
    width = 64
    lines = [f" {result['label']} ".center(width, "=")]

    def row(name: str, value: object) -> None:
        lines.append(f"{name + ':':<40}{_fmt(value):>24}")

    rate = result["request_rate"]
    row("Backend", f"{result['backend']} {result['endpoint']}")
    row("Model", result["model"] or "-")
    row("Request rate (req/s)", "all at once" if rate is None else rate)
    row("Max concurrency", result["max_concurrency"] or "no limit")
    row("Prompts (input, output tokens)", f"{result['input_len']}, {result['output_len']}")
    row("Completed requests", result["completed"])
    row("Failed requests", result["failed"])
    if result.get("retried"):
        row("Resent (connection closed by server)", result["retried"])
    row("Duration (s)", result["duration"])
    row("Total input tokens", result["total_input_tokens"])
    sources = ", ".join(f"{k} {v}" for k, v in result["output_tokens_source"].items())
    row("Total output tokens", f"{result['total_output_tokens']} ({sources or 'none'})")
    row("Request throughput (req/s)", result["request_throughput"])
    row("Input token throughput (tok/s)", result["input_throughput"])
    row("Output token throughput (tok/s)", result["output_throughput"])
    row("Total token throughput (tok/s)", result["total_throughput"])
    row("Concurrency", result["concurrency"])
    load = result["client_cpu_load"]
    row("Client CPU (s, share of one core)", f"{result['client_cpu_time']:.2f} ({load:.0%})")
    lines.append("-" * width)
    header = "".join(f"{stat:>12}" for stat in ("mean", "p50", "p90", "p99"))
    lines.append(f"{'Latency (ms)':<16}{header}")
    for metric, name in zip(METRICS, ("TTFT", "TPOT", "ITL", "E2E"), strict=True):
        cells = [result[f"{stat}_{metric}_ms"] for stat in ("mean", "median", "p90", "p99")]
        lines.append(f"{name:<16}" + "".join(f"{_fmt(c):>12}" for c in cells))
    server = result["server_e2e"]
    if server is not None:
        lines.append("-" * width)
        row("Server e2e_latency, mean (ms)", server["mean_server_ms"])
        row("Client - server e2e, mean (ms)", server["mean_diff_ms"])
        row("Client / server e2e, ratio of means", server["ratio"])
    for title, reasons in (
        ("Failures", result["failure_reasons"]),
        ("Warm-up failures", result["warmup_failure_reasons"]),
    ):
        if reasons:
            lines.append("-" * width)
            lines.append(f"{title}:")
            lines.extend(f"{count:>6}  {reason}" for reason, count in reasons.items())
    lines.append("=" * width)
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)
