"""`Worker`: one upstream server the front forwards to, with its breaker and its counters.

Synopsis::

    worker = Worker("http://10.0.0.5:30000", "sglang", Breaker(), id=1)
    with worker.attempt() as tracker:            # counted in worker.in_flight meanwhile
        async with client.stream("POST", url, json=body, extensions=tracker.extensions):
            ...
        tracker.sent                             # the worker had the whole request

A worker is available while it is in the fleet, its last health probe passed (or its breaker
is half-open: then a request may be the trial that decides) and its breaker lets a request
through. The fields are plain counters the fleet, the health probes and the forwarding path
update in place (one Trio run, no lock); `Worker.stats` is what `/workers` and `/metrics`
read of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal
from urllib.parse import urlsplit

from ..request import WorkerStats
from .breaker import Breaker
from .wire import SendTracker

__all__ = [
    "RemoteWorkerStats",
    "Worker",
    "WorkerKind",
    "normalize_url",
]

#: The API a worker speaks: SGLang's native /generate (SGLang, another Tributary), or only
#: OpenAI's /v1 (vLLM, llama.cpp's server).
WorkerKind = Literal["sglang", "openai"]


@dataclasses.dataclass(eq=False)
class Worker:
    url: str  # base URL, normalized: no trailing slash
    kind: WorkerKind
    breaker: Breaker
    #: The fleet's number for it (1, 2, ... in the order workers were added; never reused):
    #: what a client's error message names, never its URL (an internal address).
    id: int = 0
    in_flight: int = 0  # requests currently forwarded to it (`attempt` counts them)
    requests_total: int = 0  # attempts sent to it
    errors_total: int = 0  # attempts that failed
    retries_total: int = 0  # attempts that failed here before any output, retried elsewhere
    healthy: bool = True  # the health probes' verdict (see `health`)
    #: Health probes in a row that passed (> 0) or failed (< 0).
    probe_streak: int = 0
    removed: bool = False  # set when removed from the fleet (in-flight requests finish)

    def available(self) -> bool:
        """Whether `Fleet.choose` may pick it now (takes no half-open trial)."""
        if self.removed:
            return False
        if not self.healthy and self.breaker.state != "half_open":
            return False
        return self.breaker.would_allow()

    @contextmanager
    def attempt(self) -> Iterator[SendTracker]:
        """One try of a request on this worker (the worker as `attempt.Attempts` picked
        it), counted in `in_flight` until the block ends, however it ends. The tracker goes
        with the request (`client.stream(..., extensions=tracker.extensions)`): once
        `tracker.sent`, the worker had the whole request, and a failure that follows is
        never retried on another worker (`upstream.Upstream.worker_failed`)."""
        self.in_flight += 1
        try:
            yield SendTracker()
        finally:
            self.in_flight -= 1

    def stats(self) -> WorkerStats:
        """What `/workers` and `/metrics` show of it."""
        return RemoteWorkerStats(
            id=self.id,
            url=self.url,
            kind=self.kind,
            breaker=self.breaker.state,
            healthy=self.healthy,
            in_flight=self.in_flight,
            requests_total=self.requests_total,
            errors_total=self.errors_total,
            retries_total=self.retries_total,
            breaker_opened_total=self.breaker.opened_total,
        )


def normalize_url(url: str) -> str:
    """`url` without trailing slashes; ValueError unless it is an absolute http(s) URL."""
    base = url.strip().rstrip("/")
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker URL {url!r} is not an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise ValueError(f"worker URL {url!r} has a query or fragment; give the base URL")
    return base


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteWorkerStats(WorkerStats):
    """`WorkerStats` with the worker's number in the fleet (what client errors name)."""

    id: int = 0
