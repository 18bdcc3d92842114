"""Health probes: GET {url}/health on every worker, each round concurrent and bounded, so the
fleet stops choosing a worker that is down before a request finds out the hard way.

Synopsis::

    async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
        await nursery.start(run_health_checks, fleet, client)   # returns after the first round
        ...                                                     # serve; cancel to stop

A 200 marks the worker healthy and counts as a success for its breaker: if half-open, it is
the trial that closes it (a worker that came back rejoins without risking a user's request);
if closed, it ends a run of failures; if open, it changes nothing (the wait is not cut short:
a worker that just failed several requests gets `open_seconds` of rest). Anything else
(another status, a refused connection, no answer within `timeout`) marks it unhealthy and
counts as a failure for its breaker, so a worker that stays down opens its breaker and is
retried only by the probes. One worker's failure never ends the loop.

SGLang's gateway probes every 30 s with a 10 s timeout and wants 2 passes or 3 failures to
change its verdict; here one probe decides `healthy` and the breaker supplies the hysteresis.
"""

from __future__ import annotations

import httpx
import trio

from .fleet import Fleet, Worker

__all__ = ["check_fleet_health", "run_health_checks"]


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
    next_round = trio.current_time() + interval
    await check_fleet_health(fleet, client, timeout=timeout)
    task_status.started()
    while True:
        await trio.sleep_until(next_round)
        next_round = trio.current_time() + interval
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
            response = await client.get(f"{worker.url}/health")
        except httpx.HTTPError:
            pass
        else:
            ok = response.status_code == 200
    if worker.removed:
        return  # left the fleet while the probe ran: nobody reads its verdict
    worker.healthy = ok
    if ok:
        worker.breaker.record_success()
    else:
        worker.breaker.record_failure()
