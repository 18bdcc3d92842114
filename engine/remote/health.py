"""Health probes: GET {url}/health on every worker, each round concurrent and bounded, so the
fleet stops choosing a worker that is down before a request finds out the hard way.

Synopsis::

    async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
        await nursery.start(run_health_checks, fleet, client)   # returns after the first round
        ...                                                     # serve; cancel to stop

A 200 counts as a success for the worker's breaker: if half-open, it is the trial that
closes it (a worker that came back rejoins without risking a user's request); if closed, it
ends a run of failures; if open, it changes nothing (the wait is not cut short: a worker that
just failed several requests gets `open_seconds` of rest). Anything else (another status, a
refused connection, no answer within `timeout`) counts as a failure for its breaker, so a
worker that stays down opens its breaker and is retried only by the probes. One worker's
failure never ends the loop.

The verdict (`Worker.healthy`) changes as SGLang's gateway's does: after
`FAILURES_TO_UNHEALTHY` failed probes in a row, and back after `PASSES_TO_HEALTHY` passes in
a row. One probe that misses its timeout on a busy machine must not take a working fleet out
of service: every worker marked unhealthy at once would have every request refused with a
503 until the next round (`tests/remote/test_health_flap.py`).
"""

from __future__ import annotations

from contextlib import aclosing

import httpx
import trio
from trio_util import periodic

from .fleet import Fleet
from .wire import read_error_body
from .worker import Worker

__all__ = ["FAILURES_TO_UNHEALTHY", "PASSES_TO_HEALTHY", "check_fleet_health", "run_health_checks"]

#: Failed probes in a row that mark a worker unhealthy, and passes in a row that mark it
#: healthy again (SGLang's gateway's thresholds).
FAILURES_TO_UNHEALTHY = 3
PASSES_TO_HEALTHY = 2

#: The most of a `/health` answer's body a probe reads.
PROBE_BODY_LIMIT = 64 << 10


async def run_health_checks(
    fleet: Fleet,
    client: httpx.AsyncClient,
    *,
    interval: float = 5.0,
    timeout: float = 2.0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Probe the fleet every `interval` seconds (start to start; a round lasts at most
    `timeout`) until cancelled. Reports started after the first round, so the caller begins
    with verdicts. Workers added meanwhile are probed from the next round, removed ones no
    longer. Cancellation ends the round in progress; a probe cut short records nothing."""
    # `periodic` waits from one round's start to the next's, at once after an overrun.
    rounds = periodic(interval)
    async with aclosing(rounds):
        await anext(rounds)
        await check_fleet_health(fleet, client, timeout=timeout)
        task_status.started()
        async for _ in rounds:
            await check_fleet_health(fleet, client, timeout=timeout)


async def check_fleet_health(fleet: Fleet, client: httpx.AsyncClient, *, timeout: float) -> None:
    """One round: probe every current worker concurrently, each within `timeout` seconds."""
    async with trio.open_nursery() as nursery:
        for worker in fleet.workers:
            nursery.start_soon(_probe, worker, client, timeout)


async def _probe(worker: Worker, client: httpx.AsyncClient, timeout: float) -> None:
    ok = False
    with trio.move_on_after(timeout):
        try:
            async with client.stream("GET", f"{worker.url}/health") as response:
                # The status is the verdict; the body (empty, as a rule) is read within a
                # bound only so that the connection can be kept alive.
                await read_error_body(response, PROBE_BODY_LIMIT)
                ok = response.status_code == 200
        except httpx.HTTPError:
            pass
    if worker.removed:
        return  # left the fleet while the probe ran: nobody reads its verdict
    if ok:
        worker.probe_streak = max(worker.probe_streak, 0) + 1
        if worker.probe_streak >= PASSES_TO_HEALTHY:
            worker.healthy = True
        worker.breaker.record_success()
    else:
        worker.probe_streak = min(worker.probe_streak, 0) - 1
        if -worker.probe_streak >= FAILURES_TO_UNHEALTHY:
            worker.healthy = False
        worker.breaker.record_failure()
