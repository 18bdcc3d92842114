"""`Metrics`: SGLang's Prometheus metrics for one app, served by `GET /metrics`.

Synopsis::

    metrics = Metrics(engine, model_name="SmolLM2")   # one per app, with its own registry
    metrics.observe_finished(record)                  # once per answer, as its exchange ends
    metrics.observe_inter_token_latency(interval, n)  # per output item after the first
    metrics.count_http("/generate", "POST", 200)      # once per HTTP exchange
    body = metrics.render()                           # Prometheus text format

Names, labels and bucket bounds are SGLang's (`python/sglang/srt/metrics/collector.py`), so
dashboards built for SGLang read them; finer buckets below 0.1 s are added for CPU latencies.
Every series carries `model_name`.

Series are bounded: no label takes a client's text. `endpoint` is a route's rule or
"unmatched", `method` one of `KNOWN_METHODS` or "other", `status_code` a status the app sent;
`model_name` is the server's, `worker` a worker's number in the fleet (never its URL).

Cost: the hot path touches plain ints and lists (no prometheus-client objects, so no lock
per increment; the app runs on one Trio thread). prometheus-client is used at scrape time
only: this object is the registry's one collector and builds the metric families from those
numbers, and the gauges from the engine's live state (`Engine.stats`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from tributary.engine import EngineStats, FleetService

if TYPE_CHECKING:
    from .record import RequestRecord

__all__ = ["CONTENT_TYPE", "KNOWN_METHODS", "Metrics", "method_label", "status_label"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

#: Sub-100 ms bounds for a CPU server, then SGLang's own bounds (kept, so quantiles over
#: SGLang's buckets mean the same here).
_FINE = [0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08]
_SGLANG_TTFT = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
TTFT_BUCKETS = [*_FINE, *_SGLANG_TTFT]
E2E_BUCKETS = [*TTFT_BUCKETS, 600, 1200, 1800, 2400]
# SGLang's inter-token bounds start at 2 ms.
ITL_BUCKETS = [0.001, 0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035]
ITL_BUCKETS += [0.040, 0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1, 2, 4, 6, 8]
# SGLang's queue bounds start at 0 (admitted at once) and reach 50 minutes.
QUEUE_BUCKETS = [0.0, *_FINE, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60]
QUEUE_BUCKETS += [70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200]
QUEUE_BUCKETS += [1400, 1600, 1800, 2000, 2500, 3000]


#: HTTP methods counted under their own name (RFC 9110's, and PATCH). A client chooses the
#: method, and h11 accepts any token up to the header size limit as one: each new name
#: would be a new series of every HTTP counter, kept for the life of the process (4,000
#: refused requests with made-up methods grew /metrics to 65 MB). Any other is "other".
KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "CONNECT", "TRACE"}
)
OTHER = "other"


def method_label(method: str) -> str:
    """The `method` label of an exchange: its method if in `KNOWN_METHODS`, else "other"."""
    return method if method in KNOWN_METHODS else OTHER


def status_label(status: int) -> str:
    """The `status_code` label: the status the app sent (100-599; the server's own 499 for
    a client that left first), anything else "other"."""
    return str(status) if 100 <= status <= 599 else OTHER


class StatsSource(Protocol):
    def stats(self) -> EngineStats: ...


class _Histogram:
    """Bucket counts and a sum; cumulative only when scraped."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value` (SGLang's shortcut for a frame of several tokens)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def family(self, name: str, doc: str, model: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=["model_name"])
        buckets, total = [], 0
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            total += count
            buckets.append((floatToGoString(bound), total))
        family.add_metric([model], buckets, self.sum)
        return family


class Metrics:
    def __init__(
        self, engine: StatsSource, *, model_name: str, fleet: FleetService | None = None
    ) -> None:
        self.engine = engine
        #: A front's workers (`Capabilities.fleet`); None with a model of its own.
        self._fleet = fleet
        self.model_name = model_name
        self.time_to_first_token = _Histogram(TTFT_BUCKETS)
        self.inter_token_latency = _Histogram(ITL_BUCKETS)
        self.e2e_request_latency = _Histogram(E2E_BUCKETS)
        self.queue_time = _Histogram(QUEUE_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.num_requests = 0
        self.tool_call_requests = 0
        #: (endpoint, method) and (endpoint, method, status code) -> count
        self.http_requests: dict[tuple[str, str], int] = {}
        self.http_responses: dict[tuple[str, str, str], int] = {}
        self._throughput_mark = self._mark(engine.stats())
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # -- the hot path ---------------------------------------------------------------------

    def observe_finished(self, record: RequestRecord) -> None:
        """One request that ended with an answer (the `e2e_latency` its response carries);
        which ones are answers, the exchange decides (`exchange.answers`)."""
        self.num_requests += 1
        self.prompt_tokens += record.prompt_tokens
        self.generation_tokens += record.completion_tokens
        self.cached_tokens += record.cached_tokens
        if record.finish == "tool_calls":
            self.tool_call_requests += 1
        if record.e2e_latency is not None:
            self.e2e_request_latency.observe(record.e2e_latency)
        if record.queue_time is not None:
            self.queue_time.observe(record.queue_time)
        if record.time_to_first_token is not None:
            self.time_to_first_token.observe(record.time_to_first_token)

    def observe_inter_token_latency(self, interval: float, tokens: int) -> None:
        """An output item that brought `tokens` new tokens `interval` s after the previous
        one: `tokens` observations of `interval / tokens` (SGLang's rule)."""
        self.inter_token_latency.observe(interval / tokens, tokens)

    def count_http(self, endpoint: str, method: str, status: int) -> None:
        """One HTTP exchange. `endpoint` must be a route's rule or "unmatched" (never the
        path); `method` and `status` are bounded here (`method_label`, `status_label`)."""
        method = method_label(method)
        key = (endpoint, method)
        self.http_requests[key] = self.http_requests.get(key, 0) + 1
        rkey = (endpoint, method, status_label(status))
        self.http_responses[rkey] = self.http_responses.get(rkey, 0) + 1

    # -- scrape time ----------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        model = self.model_name
        yield self.time_to_first_token.family(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            model,
        )
        yield self.inter_token_latency.family(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            model,
        )
        yield self.e2e_request_latency.family(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            model,
        )
        yield self.queue_time.family(
            "sglang:queue_time_seconds", "Histogram of queueing time in seconds.", model
        )
        stats = self.engine.stats()
        for name, doc, value in (
            ("prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
            ("generation_tokens", "Number of generation tokens processed.", self.generation_tokens),
            ("cached_tokens", "Number of cached prompt tokens.", self.cached_tokens),
            ("num_requests", "Number of requests processed.", self.num_requests),
            ("num_aborted_requests", "Number of requests aborted.", stats.aborted_requests),
        ):
            counter = CounterMetricFamily(f"sglang:{name}", doc, labels=["model_name"])
            counter.add_metric([model], value)
            yield counter
        tools = CounterMetricFamily(
            "tributary:tool_call_requests",
            "Answers read into tool calls (finish_reason tool_calls, stop_reason tool_use).",
            labels=["model_name"],
        )
        tools.add_metric([model], self.tool_call_requests)
        yield tools
        for name, doc, value in (  # vLLM's spec_decode_* names
            ("num_drafts", "Steps that verified drafted tokens.", stats.spec_verifies),
            ("num_draft_tokens", "Tokens drafted (n-gram speculation).", stats.spec_draft_tokens),
            ("num_accepted_tokens", "Drafted tokens kept.", stats.spec_accepted_tokens),
        ):
            counter = CounterMetricFamily(
                f"tributary:spec_decode_{name}", doc, labels=["model_name"]
            )
            counter.add_metric([model], value)
            yield counter
        yield from self._http_families(model)
        yield from self._gauges(stats, model)
        yield from self._worker_families()

    def _worker_families(self) -> Iterator[Metric]:
        """Per remote worker, labelled by its number in the fleet, "1", "2", ... (a front
        serving a fleet; nothing otherwise): the number client errors name. Never its URL:
        /metrics needs no more than the API key, and worker URLs are internal addresses
        (`/list_workers`, behind the admin key, maps numbers to URLs)."""
        fleet = self._fleet
        if fleet is None:
            return
        # A front's fixed reasons (engine/remote/wire.py).
        counter = CounterMetricFamily(
            "tributary:front_upstream_failures",
            "Requests ended by a worker's failure after it had them, never retried.",
            labels=["reason"],
        )
        for reason, value in fleet.upstream_failures.items():
            counter.add_metric([reason], value)
        yield counter
        workers = fleet.worker_stats()
        if not workers:
            return
        for name, doc, field in (
            ("worker_requests", "Requests sent to the worker (attempts).", "requests_total"),
            ("worker_errors", "Attempts that failed on the worker.", "errors_total"),
            ("worker_retries", "Attempts retried elsewhere after failing here.", "retries_total"),
            ("worker_breaker_opened", "Times the worker's breaker opened.", "breaker_opened_total"),
        ):
            counter = CounterMetricFamily(f"tributary:{name}", doc, labels=["worker"])
            for w in workers:
                counter.add_metric([_worker_label(w)], getattr(w, field))
            yield counter
        in_flight = GaugeMetricFamily(
            "tributary:worker_in_flight", "Requests in flight on the worker.", labels=["worker"]
        )
        healthy = GaugeMetricFamily(
            "tributary:worker_healthy", "1 if the last health check passed.", labels=["worker"]
        )
        breaker = GaugeMetricFamily(
            "tributary:worker_breaker_state",
            "1 for the breaker's current state (closed, open, half_open).",
            labels=["worker", "state"],
        )
        for w in workers:
            label = _worker_label(w)
            in_flight.add_metric([label], w.in_flight)
            healthy.add_metric([label], 1.0 if w.healthy else 0.0)
            for state in ("closed", "open", "half_open"):
                breaker.add_metric([label, state], 1.0 if w.breaker == state else 0.0)
        yield in_flight
        yield healthy
        yield breaker

    def _http_families(self, model: str) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "sglang:http_requests",
            "Total number of HTTP requests by endpoint and method",
            labels=["endpoint", "method", "model_name"],
        )
        for (endpoint, method), value in sorted(self.http_requests.items()):
            requests.add_metric([endpoint, method, model], value)
        yield requests
        responses = CounterMetricFamily(
            "sglang:http_responses",
            "Total number of HTTP responses by endpoint and status code",
            labels=["endpoint", "status_code", "method", "model_name"],
        )
        for (endpoint, method, status), value in sorted(self.http_responses.items()):
            responses.add_metric([endpoint, status, method, model], value)
        yield responses

    @staticmethod
    def _mark(stats: EngineStats) -> tuple[float, int] | None:
        """(now, tokens generated so far): where the next gen_throughput starts. None outside
        a Trio run (an app may be built before `trio.run`): the first scrape starts it."""
        try:
            return trio.current_time(), stats.generated_tokens
        except RuntimeError:
            return None

    def _gauges(self, stats: EngineStats, model: str) -> Iterator[Metric]:
        throughput = 0.0
        mark, self._throughput_mark = self._throughput_mark, self._mark(stats)
        if mark is not None and self._throughput_mark is not None:
            elapsed = self._throughput_mark[0] - mark[0]
            if elapsed > 0:
                throughput = (stats.generated_tokens - mark[1]) / elapsed
        usage = stats.kv_used_cells / stats.kv_total_cells if stats.kv_total_cells else 0.0
        for name, doc, value in (
            ("num_running_reqs", "The number of running requests.", stats.running),
            ("num_queue_reqs", "The number of requests in the waiting queue.", stats.waiting),
            ("gen_throughput", "The generation throughput (token/s).", throughput),
            ("token_usage", "The token usage.", usage),
            ("num_used_tokens", "The number of used tokens.", stats.kv_used_cells),
        ):
            gauge = GaugeMetricFamily(f"sglang:{name}", doc, labels=["model_name"])
            gauge.add_metric([model], value)
            yield gauge


def _worker_label(worker: object) -> str:
    """A worker's `worker` label: its number in the fleet (`RemoteWorkerStats.id`)."""
    return str(getattr(worker, "id", "") or "unknown")
