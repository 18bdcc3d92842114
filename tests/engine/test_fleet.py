"""The fleet of upstream workers: the circuit breaker on the autojump clock."""

from __future__ import annotations

import trio

from tributary.engine.remote.breaker import Breaker

# -- the circuit breaker ---------------------------------------------------------------------


async def half_open(breaker: Breaker) -> Breaker:
    """`breaker`, opened by a run of failures and then left alone for `open_seconds`."""
    for _ in range(breaker.failure_threshold):
        breaker.record_failure()
    await trio.sleep(breaker.open_seconds)
    return breaker


async def test_breaker_opens_after_consecutive_failures_and_refuses_while_open(
    autojump_clock: trio.abc.Clock,
) -> None:
    breaker = Breaker(failure_threshold=3, open_seconds=5.0)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # the run is broken: counting starts again
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state == "closed" and breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open"
    assert breaker.opened_total == 1
    await trio.sleep(4.9)
    assert breaker.state == "open"
    assert not breaker.allow() and not breaker.would_allow()


async def test_breaker_half_open_lets_one_trial_through_and_closes_on_success(
    autojump_clock: trio.abc.Clock,
) -> None:
    breaker = await half_open(Breaker(failure_threshold=1, open_seconds=5.0))
    assert breaker.state == "half_open"
    assert breaker.would_allow() and breaker.would_allow()  # asking takes nothing
    assert breaker.allow()
    assert not breaker.allow()  # the trial is out
    assert not breaker.would_allow()
    breaker.record_success()
    assert breaker.state == "closed"
    assert all(breaker.allow() for _ in range(5))


async def test_breaker_reopens_when_the_trial_fails_and_waits_afresh(
    autojump_clock: trio.abc.Clock,
) -> None:
    breaker = await half_open(Breaker(failure_threshold=2, open_seconds=5.0))
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open" and breaker.opened_total == 2
    await trio.sleep(4.0)
    assert breaker.state == "open"  # the wait restarted at the failed trial
    await trio.sleep(1.0)
    assert breaker.state == "half_open"


async def test_breaker_success_threshold_needs_that_many_trials(
    autojump_clock: trio.abc.Clock,
) -> None:
    breaker = await half_open(Breaker(failure_threshold=1, success_threshold=2, open_seconds=1))
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "half_open"
    assert breaker.allow() and not breaker.allow()  # the second trial, still one at a time
    breaker.record_success()
    assert breaker.state == "closed"


async def test_breaker_a_trial_never_reported_is_lost_after_open_seconds(
    autojump_clock: trio.abc.Clock,
) -> None:
    breaker = await half_open(Breaker(failure_threshold=1, open_seconds=5.0))
    assert breaker.allow()  # its request is cancelled: no outcome comes
    await trio.sleep(4.9)
    assert not breaker.allow()
    await trio.sleep(0.1)
    assert breaker.allow()
