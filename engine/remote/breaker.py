"""A per-worker circuit breaker: after a run of failures, stop sending a worker requests for a
while, then let one trial through to find out whether it is back.

Synopsis::

    breaker = Breaker(failure_threshold=3, open_seconds=5.0)
    if breaker.allow():                 # takes the half-open trial, if that is the state
        ok = await forward(request)
        breaker.record_success() if ok else breaker.record_failure()

States and transitions follow SGLang's model gateway (sgl-router `core/circuit_breaker.rs`):
`failure_threshold` consecutive failures open it (a success resets the count); after
`open_seconds` it is half-open; `success_threshold` consecutive successes there close it and
one failure opens it again. Two differences, both deliberate:

- Half-open lets **one** trial through at a time, where SGLang lets every request through.
  A worker that just came back from an outage is the worst place to send a burst of traffic,
  and a burst would turn one failure into many.
- A trial whose outcome is never recorded (its request was cancelled: the client left) is
  treated as lost after `open_seconds`, so the worker is not shut out for good.

Time is Trio's clock, so tests drive it with `autojump_clock`. Not thread-safe: a breaker
belongs to one Trio run.
"""

from __future__ import annotations

from typing import Literal

import trio

__all__ = ["Breaker", "BreakerState"]

#: closed: requests flow, failures are counted. open: no request is sent until `open_seconds`
#: have passed. half_open: one trial at a time decides between closed and open.
BreakerState = Literal["closed", "open", "half_open"]


class Breaker:
    """Per-worker circuit breaker on Trio's clock (`trio.current_time()`)."""

    def __init__(
        self, *, failure_threshold: int = 3, success_threshold: int = 1, open_seconds: float = 5.0
    ) -> None:
        if failure_threshold < 1 or success_threshold < 1:
            raise ValueError("failure_threshold and success_threshold must be at least 1")
        if open_seconds < 0:
            raise ValueError(f"open_seconds must not be negative, not {open_seconds}")
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.open_seconds = open_seconds
        #: Times it opened (from closed or from half-open), for metrics.
        self.opened_total = 0
        self._state: BreakerState = "closed"
        self._failures = 0  # consecutive, while closed
        self._successes = 0  # consecutive, while half-open
        self._opened_at = 0.0
        self._trial_started: float | None = None  # the half-open trial in flight, if any

    @property
    def state(self) -> BreakerState:
        """The current state; reading it moves open to half_open once `open_seconds` passed."""
        if self._state == "open" and trio.current_time() - self._opened_at >= self.open_seconds:
            self._state = "half_open"
            self._successes = 0
            self._trial_started = None
        return self._state

    def would_allow(self) -> bool:
        """What `allow()` would answer now, without taking the half-open trial (for filtering
        candidates: `Worker.available()`)."""
        state = self.state
        if state == "half_open":
            return (
                self._trial_started is None
                or trio.current_time() - self._trial_started >= self.open_seconds
            )
        return state == "closed"

    def allow(self) -> bool:
        """Whether a request may go to the worker now: closed yes, open no, half-open yes for
        one trial until its outcome is recorded. A True in half-open takes that trial, so ask
        once per request sent (`Fleet.choose` asks for the worker it returns)."""
        if not self.would_allow():
            return False
        if self._state == "half_open":
            self._trial_started = trio.current_time()
        return True

    def record_success(self) -> None:
        """Closed: ends a run of failures. Half-open: a trial passed. Open: nothing (a request
        sent before it opened came back; the wait is not cut short)."""
        if self.state == "half_open":
            self._trial_started = None
            self._successes += 1
            if self._successes >= self.success_threshold:
                self._state = "closed"
        self._failures = 0

    def record_failure(self) -> None:
        """Closed: one more in the run (the run's `failure_threshold`-th opens it). Half-open:
        the trial failed, open again and wait afresh. Open: nothing."""
        state = self.state
        if state == "half_open":
            self._open()
        elif state == "closed":
            self._failures += 1
            if self._failures >= self.failure_threshold:
                self._open()

    def _open(self) -> None:
        self._state = "open"
        self._opened_at = trio.current_time()
        self._failures = 0
        self._trial_started = None
        self.opened_total += 1

    def __repr__(self) -> str:
        return f"<Breaker {self._state} opened_total={self.opened_total}>"
