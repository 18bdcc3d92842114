"""PNG plots of benchmark results, drawn with matplotlib (the `bench` extra).

Figures are built with `matplotlib.figure.Figure` and rendered by Agg directly, never through
pyplot: no display is needed and no global backend or figure state is touched.

Synopsis::

    results = [load_result(p) for p in paths]
    plot_latency_cdfs(results, "docs/benchmarks/plots")          # ttft_cdf.png, e2e_latency_cdf.png
    plot_throughput_vs_concurrency(results, "docs/benchmarks/plots/throughput.png")

Both accept results of `sglang.bench_serving` or `vllm bench serve` for the throughput plot
(they share `max_concurrency` and `output_throughput`); the CDFs need `tributary bench`'s
per-request records.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_latency_cdfs", "plot_throughput_vs_concurrency"]

CDF_METRICS = {"ttft": "Time to first token", "e2e_latency": "End-to-end latency"}


def plot_latency_cdfs(
    results: Sequence[Mapping[str, Any]], out_dir: str | Path, *, prefix: str = ""
) -> list[Path]:
    """One PNG per metric (`{prefix}ttft_cdf.png`, `{prefix}e2e_latency_cdf.png`) with a
    curve per result, over its completed requests. Returns the files written."""
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for metric, title in CDF_METRICS.items():
        figure = Figure(figsize=(6.4, 4.2), layout="constrained")
        axes = figure.add_subplot()
        for result in results:
            values = sorted(
                r[metric] * 1000
                for r in result.get("requests", [])
                if r.get("ok") and r.get(metric) is not None
            )
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                axes.step(values, fractions, where="post", label=_label(result))
        axes.set_title(f"{title}, CDF")
        axes.set_xlabel("ms")
        axes.set_ylabel("fraction of completed requests")
        axes.set_ylim(0, 1.02)
        axes.grid(True, alpha=0.3)
        if len(results) > 1:
            axes.legend(fontsize="small")
        path = out / f"{prefix}{metric}_cdf.png"
        figure.savefig(path, dpi=110)
        written.append(path)
    return written


def plot_throughput_vs_concurrency(
    results: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    metric: str = "output_throughput",
    ylabel: str = "output tokens/s",
) -> Path:
    """`metric` against `max_concurrency`, one line per label (server): the side-by-side
    plot. Results without a max_concurrency (pure request-rate runs) are left out."""
    from matplotlib.figure import Figure

    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for result in results:
        if result.get("max_concurrency") and result.get(metric) is not None:
            lines[_label(result)].append((int(result["max_concurrency"]), float(result[metric])))
    figure = Figure(figsize=(6.4, 4.2), layout="constrained")
    axes = figure.add_subplot()
    for label, points in lines.items():
        points.sort()
        axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
    concurrencies = sorted({x for points in lines.values() for x, _ in points})
    if concurrencies and concurrencies[-1] > 2 * concurrencies[0]:
        axes.set_xscale("log", base=2)
    axes.set_xticks(concurrencies, [str(c) for c in concurrencies])
    axes.minorticks_off()
    axes.set_xlabel("concurrency (requests in flight)")
    axes.set_ylabel(ylabel)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    if lines:
        axes.legend(fontsize="small")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=110)
    return target


def _label(result: Mapping[str, Any]) -> str:
    return str(result.get("label") or result.get("backend") or "run")
