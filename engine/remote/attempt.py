"""`Attempts`: which worker a request tries next, first and after each failure (retry with
worker exclusion and backoff), for the items the front forwards and the requests it hands
to a worker whole.

Synopsis::

    attempts = Attempts(fleet, config, prompt, deadline=stream.deadline)
    while (worker := await attempts.next()) is not None:
        with worker.attempt() as tracker:
            ...                 # one try; return once it answered, else try the next one

A try's outcome is the caller's to judge (`upstream.Upstream.worker_failed` says whether a
failure may go to another worker: never once the worker had the whole request).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import trio

from .fleet import Fleet
from .policy import RoutingKey
from .worker import Worker, WorkerKind

__all__ = ["NO_WORKER", "Attempts", "RetryConfig", "Together"]

#: The message of a request's 503 when no worker could be tried at all (the fleet empty, or
#: every worker down or with its breaker open); after a failed try, that failure is the one.
NO_WORKER = "No worker is available to serve the request."


@dataclasses.dataclass(eq=False)
class Together:
    """Requests that go to one worker: the items of one client request (a batch, n > 1),
    as SGLang's gateway forwards a batch body to one worker whole. `worker` is the one the
    first pick chose (a retry that must go elsewhere moves them all); once `lost` is set (one
    of them was lost by a worker that had it: `dropped`, `timeout`), the others go nowhere
    and end with it."""

    worker: Worker | None = None
    lost: Exception | None = None


class RetryConfig(Protocol):
    """The retry settings `Attempts` reads (`RemoteConfig` has them)."""

    @property
    def max_retries(self) -> int: ...

    @property
    def retry_backoff(self) -> float: ...

    @property
    def retry_backoff_max(self) -> float: ...


class Attempts:
    """Which worker a request tries next, for the RemoteEngine's items and the requests it
    hands to a worker whole (`passthrough`): first the policy's pick; after a failure,
    another worker not tried yet, once a backoff (`retry_backoff * 2**(k-1)`, at most
    `retry_backoff_max`) has passed, at most `max_retries` times and never when the backoff
    would end past `deadline`. Each pick is counted (`requests_total`, the previous worker's
    `retries_total`) and recorded with the policy. With `together`, the requests that share
    it go to its worker while they can (`Together`), and nowhere once it is `lost`."""

    def __init__(
        self,
        fleet: Fleet,
        config: RetryConfig,
        key: RoutingKey | None,
        *,
        deadline: float,
        skip_kind: WorkerKind | None = None,
        together: Together | None = None,
    ) -> None:
        self._fleet = fleet
        self._config = config
        self._key = key
        self._deadline = deadline
        self._skip_kind = skip_kind
        self._together = together
        self.tried: list[Worker] = []

    async def next(self) -> Worker | None:
        """The worker to try now, after the backoff a retry waits; None when there is none
        or the retries are spent."""
        config, tried = self._config, self.tried
        if tried:
            if len(tried) > config.max_retries:
                return None
            backoff = min(config.retry_backoff * 2 ** (len(tried) - 1), config.retry_backoff_max)
            if trio.current_time() + backoff >= self._deadline:
                return None
            await trio.sleep(backoff)
        together = self._together
        if together is not None and together.lost is not None:
            return None
        exclude = list(tried)
        if self._skip_kind is not None:
            exclude += [w for w in self._fleet.workers if w.kind == self._skip_kind]
        worker = None
        if together is not None and together.worker is not None:
            shared = together.worker
            # A first try follows the first pick (its half-open trial is theirs, shared); a
            # retry follows a worker that another retry of theirs moved to, if it can.
            if shared not in exclude and not shared.removed and (not tried or shared.available()):
                worker = shared
        if worker is None:
            worker = self._fleet.choose(self._key, exclude=exclude)
            if worker is None:
                return None
            if together is not None:
                together.worker = worker
        if tried:
            tried[-1].retries_total += 1
        tried.append(worker)
        worker.requests_total += 1
        self._fleet.record_dispatch(worker, self._key)
        return worker
