"""The upstream workers Tributary forwards to, and the choice of one for each request.

Synopsis::

    fleet = Fleet([("http://10.0.0.5:30000", "sglang")], policy="cache_aware")
    fleet.add("http://10.0.0.6:8000", "openai")
    worker = fleet.choose(prompt)               # None: no worker is available
    fleet.record_dispatch(worker, prompt)
    worker.in_flight += 1
    try:
        ...                                     # forward; then, by the outcome:
        worker.breaker.record_success()         # or record_failure()
    finally:
        worker.in_flight -= 1

A worker is available while it is in the fleet, its last health probe passed (or its breaker
is half-open: then a request may be the trial that decides) and its breaker lets a request
through. `choose` asks the breaker of the worker it returns, so a half-open worker gets one
trial at a time. The fleet holds no lock and no task: it belongs to one Trio run, and health
checks (`health.run_health_checks`) update the workers in place.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable
from typing import Literal, Protocol
from urllib.parse import urlsplit

import trio

from .breaker import Breaker as Breaker
from .policy import Policy, RoutingKey, make_policy

__all__ = ["Attempts", "Breaker", "Fleet", "Together", "Worker", "WorkerKind"]

LOGGER = logging.getLogger("tributary.engine.remote")

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
    in_flight: int = 0  # requests currently forwarded to it (the RemoteEngine counts them)
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


def normalize_url(url: str) -> str:
    """`url` without trailing slashes; ValueError unless it is an absolute http(s) URL."""
    base = url.strip().rstrip("/")
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker URL {url!r} is not an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise ValueError(f"worker URL {url!r} has a query or fragment; give the base URL")
    return base


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
