"""`tributary bench`: a serving benchmark client in the spirit of sglang.bench_serving and
vllm bench serve, with figures defined as they define them, so it measures Tributary, SGLang,
vLLM or llama.cpp's server alike over SGLang's `/generate` or OpenAI's API.

Synopsis::

    import trio
    from tributary.bench import BenchConfig, run_benchmark, render_table

    config = BenchConfig(base_url="http://127.0.0.1:30000", backend="openai", concurrency=16)
    result = trio.run(run_benchmark, config)
    print(render_table(result))

See docs/benchmarks/client.md for the flags, the metric definitions and the JSON keys.

The names below are loaded on first use: the client needs httpx (and matplotlib for plots),
which only the `bench` extra installs, and `tributary serve` imports this package for its
`bench` subcommand's flags alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backends import Backend as Backend
    from .config import BenchConfig as BenchConfig
    from .plots import plot_latency_cdfs as plot_latency_cdfs
    from .plots import plot_throughput_vs_concurrency as plot_throughput_vs_concurrency
    from .report import Result as Result
    from .report import load_result as load_result
    from .report import render_table as render_table
    from .report import write_result as write_result
    from .runner import run_benchmark as run_benchmark
    from .streams import RequestRecord as RequestRecord
    from .workload import Prompt as Prompt
    from .workload import ServerTokenizer as ServerTokenizer
    from .workload import Workload as Workload
    from .workload import WorkloadError as WorkloadError
    from .workload import WorkloadSpec as WorkloadSpec
    from .workload import build_workload as build_workload
    from .workload import load_workload as load_workload
    from .workload import save_workload as save_workload

_EXPORTS = {
    "Backend": "backends",
    "BenchConfig": "config",
    "plot_latency_cdfs": "plots",
    "plot_throughput_vs_concurrency": "plots",
    "Result": "report",
    "load_result": "report",
    "render_table": "report",
    "write_result": "report",
    "run_benchmark": "runner",
    "RequestRecord": "streams",
    "Prompt": "workload",
    "ServerTokenizer": "workload",
    "Workload": "workload",
    "WorkloadError": "workload",
    "WorkloadSpec": "workload",
    "build_workload": "workload",
    "load_workload": "workload",
    "save_workload": "workload",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
