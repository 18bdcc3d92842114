# stand-in: replaced by branch fleet
"""The workers a front serves from, their breakers, and the choice of one per attempt
(minimal stand-in: round robin only, a counting breaker)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Literal

import trio

__all__ = ["Breaker", "Fleet", "Worker", "WorkerKind"]

WorkerKind = Literal["sglang", "openai"]


class Breaker:
    def __init__(
        self, *, failure_threshold: int = 3, success_threshold: int = 1, open_seconds: float = 5.0
    ) -> None:
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.open_seconds = open_seconds
        self.opened_total = 0
        self._failures = 0
        self._opened_at: float | None = None

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "closed"
        if trio.current_time() - self._opened_at < self.open_seconds:
            return "open"
        return "half_open"

    def allow(self) -> bool:
        return self.state != "open"

    def record_success(self) -> None:
        self._failures = 0
        self._opened_at = None

    def record_failure(self) -> None:
        self._failures += 1
        if self.state == "half_open" or self._failures >= self.failure_threshold:
            if self.state != "open":
                self.opened_total += 1
            self._opened_at = trio.current_time()


@dataclasses.dataclass(eq=False)
class Worker:
    url: str
    kind: WorkerKind
    breaker: Breaker
    in_flight: int = 0
    requests_total: int = 0
    errors_total: int = 0
    retries_total: int = 0
    healthy: bool = True
    removed: bool = False

    def available(self) -> bool:
        return self.healthy and not self.removed and self.breaker.allow()


class Fleet:
    def __init__(
        self,
        workers: Iterable[tuple[str, WorkerKind]] = (),
        *,
        policy: str = "cache_aware",
        breaker_factory: Callable[[], Breaker] = Breaker,
        seed: int | None = None,
    ) -> None:
        self.policy = policy
        self._breaker_factory = breaker_factory
        self._workers: list[Worker] = []
        self._next = 0
        for url, kind in workers:
            self.add(url, kind)

    @property
    def workers(self) -> list[Worker]:
        return list(self._workers)

    def add(self, url: str, kind: WorkerKind = "sglang") -> Worker:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a worker URL starts with http:// or https://, got {url!r}")
        if any(w.url == url for w in self._workers):
            raise ValueError(f"{url} is already a worker")
        worker = Worker(url, kind, self._breaker_factory())
        self._workers.append(worker)
        return worker

    def remove(self, url: str) -> Worker:
        url = url.rstrip("/")
        for worker in self._workers:
            if worker.url == url:
                self._workers.remove(worker)
                worker.removed = True
                return worker
        raise KeyError(url)

    def choose(
        self, key: str | Sequence[int] | None, *, exclude: Collection[Worker] = ()
    ) -> Worker | None:
        candidates = [w for w in self._workers if w.available() and w not in exclude]
        if not candidates:
            return None
        self._next += 1
        return candidates[self._next % len(candidates)]

    def record_dispatch(self, worker: Worker, key: str | Sequence[int] | None) -> None:
        pass
