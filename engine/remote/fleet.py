"""`Fleet`: the upstream workers Tributary forwards to, and the choice of one for each request.

Synopsis::

    fleet = Fleet([("http://10.0.0.5:30000", "sglang")], policy="cache_aware")
    fleet.add("http://10.0.0.6:8000", "openai")
    worker = fleet.choose(prompt)               # None: no worker is available
    fleet.record_dispatch(worker, prompt)
    with worker.attempt() as tracker:           # counted in worker.in_flight meanwhile
        ...                                     # forward; then, by the outcome:
        worker.breaker.record_success()         # or record_failure()

A worker is available while it is in the fleet, its last health probe passed (or its breaker
is half-open: then a request may be the trial that decides) and its breaker lets a request
through (`Worker.available`). `choose` asks the breaker of the worker it returns, so a
half-open worker gets one trial at a time. The fleet holds no lock and no task: it belongs
to one Trio run, and health checks (`health.run_health_checks`) update the workers in place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable

from .breaker import Breaker
from .policy import Policy, RoutingKey, make_policy
from .worker import Worker, WorkerKind, normalize_url

__all__ = ["Fleet"]

LOGGER = logging.getLogger("tributary.engine.remote")


class Fleet:
    """The current workers, in the order they were added, and the policy that picks one.

    `policy` is a name from `policy.POLICIES` (ValueError otherwise) or a policy object (say a
    `CacheAware` with other thresholds). `breaker_factory()` makes each worker's breaker.
    """

    def __init__(
        self,
        workers: Iterable[tuple[str, WorkerKind]] = (),
        *,
        policy: str | Policy = "cache_aware",
        breaker_factory: Callable[[], Breaker] = Breaker,
        seed: int | None = None,
    ) -> None:
        self.policy = make_policy(policy, seed=seed) if isinstance(policy, str) else policy
        self._breaker_factory = breaker_factory
        self._workers: dict[str, Worker] = {}
        self._next_id = 1
        for url, kind in workers:
            self.add(url, kind)

    @property
    def workers(self) -> list[Worker]:
        """The current workers (not removed), in insertion order."""
        return list(self._workers.values())

    def add(self, url: str, kind: WorkerKind = "sglang") -> Worker:
        """Add a worker; ValueError naming the URL if it is not http(s) or already here, or
        if it ends in `/v1` (the front adds `/v1/completions` itself: an OpenAI client's base
        URL given here would send every request to `/v1/v1/...` and get the worker's 404)."""
        base = normalize_url(url)
        if base.endswith("/v1"):
            raise ValueError(
                f"worker {base}: give the server's own URL, without /v1 (the front adds the "
                "API paths itself)"
            )
        if base in self._workers:
            raise ValueError(f"worker {base} is already in the fleet")
        worker = Worker(base, kind, self._breaker_factory(), id=self._next_id)
        self._next_id += 1
        self._workers[base] = worker
        LOGGER.info("worker %d is %s (%s)", worker.id, base, kind)
        return worker

    def remove(self, url: str) -> Worker:
        """Take a worker out (KeyError if unknown). Requests already sent to it finish; it is
        never chosen again, and a worker added later at the same URL starts afresh."""
        base = url.strip().rstrip("/")
        if base not in self._workers:
            raise KeyError(f"no worker {base} in the fleet")
        worker = self._workers.pop(base)
        worker.removed = True
        self.policy.forget(worker)
        return worker

    def choose(self, key: RoutingKey | None, *, exclude: Collection[Worker] = ()) -> Worker | None:
        """The policy's pick among the available workers not in `exclude` (a retry excludes
        the workers that failed it), or None when there is none. A half-open worker returned
        here has had its trial taken: send it the request, then record the outcome."""
        candidates = [w for w in self._workers.values() if w not in exclude and w.available()]
        if not candidates:
            return None
        worker = self.policy.choose(candidates, key)
        worker.breaker.allow()
        return worker

    def record_dispatch(self, worker: Worker, key: RoutingKey | None) -> None:
        """A request with `key` was sent to `worker` (cache_aware remembers the prefix)."""
        self.policy.record_dispatch(worker, key)
