"""Engine-level helpers of `tributary.testing`: sim configs, idle checks, leaving streams and
injected step failures. No pytest here; these work in any Trio code."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing

from tributary.engine import (
    Done,
    Engine,
    EngineConfig,
    Error,
    Output,
    RequestStream,
    SimLatency,
    open_engine,
)
from tributary.engine.load import IdleReport
from tributary.engine.runners.sim import SimRunner

__all__ = [
    "DEFAULT_SIM_LATENCY",
    "assert_engine_idle",
    "collect",
    "fail_step",
    "garbage_cycles",
    "leave_stream_after",
    "open_sim_engine",
    "sim_config",
    "step_time",
    "wait_engine_idle",
]

#: The latency model of `sim_config()`: round numbers, so expected times are easy to write
#: down (a step costs 10 ms, plus 2 ms per decoding sequence and 1 ms per prompt token).
DEFAULT_SIM_LATENCY = SimLatency(step_base=0.010, decode_per_seq=0.002, prefill_per_token=0.001)


def sim_config(**overrides: Any) -> EngineConfig:
    """An `EngineConfig` for the sim runner: `DEFAULT_SIM_LATENCY`, a 4096-token context, and
    every other field at its default, with `overrides` (any EngineConfig field) applied.

    Failure injection is a field too: `sim_config(sim_fail_at_step=3)` makes the runner's
    third step raise `RunnerFailure` (steps are counted from 1 since the engine opened,
    failed steps included)."""
    settings: dict[str, Any] = {
        "runner": "sim",
        "sim_latency": DEFAULT_SIM_LATENCY,
        "context_length": 4096,
    }
    settings.update(overrides)
    return EngineConfig(**settings)


@asynccontextmanager
async def open_sim_engine(
    config: EngineConfig | None = None, **overrides: Any
) -> AsyncIterator[Engine]:
    """`open_engine(sim_config(**overrides))`, or `config` with `overrides` replaced."""
    if config is None:
        config = sim_config(**overrides)
    elif overrides:
        config = dataclasses.replace(config, **overrides)
    async with open_engine(config) as engine:
        yield engine


def step_time(
    latency: SimLatency = DEFAULT_SIM_LATENCY, *, decoding: int = 0, prefill: int = 0
) -> float:
    """What one sim step costs, in seconds of Trio clock: `decoding` sequences that each
    decode one token plus `prefill` prompt tokens. Under `autojump_clock` this is exact.

    The first step of a request prefills its whole prompt (up to `prefill_chunk_tokens`) and
    samples its first token; each later step decodes one token. A prompt of 5 tokens and
    `max_new_tokens=3`, alone: `step_time(prefill=5) + 2 * step_time(decoding=1)`.
    """
    return (
        latency.step_base + latency.decode_per_seq * decoding + latency.prefill_per_token * prefill
    )


def describe(report: IdleReport) -> str:
    """The non-idle fields of `report`, for assertion messages."""
    parts = [
        f"{field.name}={getattr(report, field.name)!r}"
        for field in dataclasses.fields(report)
        if field.name != "scheduler_alive" and getattr(report, field.name)
    ]
    if not report.scheduler_alive:
        parts.append("scheduler_alive=False (the engine is closed or its scheduler died)")
    return ", ".join(parts) or "idle"


def assert_engine_idle(engine: Engine) -> None:
    """Assert, now, that the engine holds nothing for any request: no running or waiting
    sequence, no KV cell in use, no runner slot held, no request id in flight, and its
    scheduler task still running (a closed engine, or one whose scheduler died, is not
    idle; see `Engine.idle_report`).

    Right after a request is cancelled or aborted its rid is free, but its sequence keeps
    its slot and KV cells until the next step boundary (at most one step later): to check
    that a cancellation cleans up, `await wait_engine_idle(engine)` first, or instead.
    Raises AssertionError naming what is left.
    """
    report = engine.idle_report()
    assert report.idle, f"the engine is not idle: {describe(report)}"


async def wait_engine_idle(engine: Engine, *, timeout: float = 10.0) -> None:
    """Wait until the engine holds nothing (see `assert_engine_idle`); AssertionError naming
    what is left if it still holds something after `timeout` seconds of Trio clock (virtual
    seconds under `autojump_clock`, where a bound such as "within one step",
    `timeout=step_time(decoding=1)`, is exact).

    It checks every millisecond of Trio clock, each time once every other task has run as
    far as it can at that instant (`trio.testing.wait_all_tasks_blocked`), so a step that
    ends exactly at the deadline has been committed and reaped before the last check. Fails
    at once if the scheduler task has ended (nothing would ever be reaped then).
    """
    deadline = trio.current_time() + timeout
    while True:
        await trio.testing.wait_all_tasks_blocked()
        report = engine.idle_report()
        if report.idle:
            return
        if not report.scheduler_alive:
            raise AssertionError(f"the engine cannot become idle: {describe(report)}")
        now = trio.current_time()
        if now >= deadline:
            break
        await trio.sleep_until(min(deadline, now + 0.001))
    raise AssertionError(
        f"the engine is still not idle after {timeout} s: {describe(engine.idle_report())}"
    )


async def collect(stream: RequestStream) -> list[Output]:
    """Read `stream` to its terminal item (`Done` or `Error`) and return every item; the
    stream is closed on the way out, however this ends."""
    async with stream:
        return [item async for item in stream]


async def leave_stream_after(stream: RequestStream, frames: int) -> list[Output]:
    """Read `frames` items from `stream`, then leave it (close it), as a consumer that stops
    reading mid-generation does; return the items read.

    Leaving aborts the request: its rid is free at once, and its sequence leaves the engine
    at the next step boundary (`wait_engine_idle`). With `frames=0` the stream is left
    before its first item. Raises AssertionError if the request ends (`Done` or `Error`)
    within those items, since then nothing was left early.
    """
    items: list[Output] = []
    async with stream:
        while len(items) < frames:
            item = await stream.__anext__()
            items.append(item)
            if isinstance(item, Done | Error):
                raise AssertionError(
                    f"the request ended after {len(items)} items, before the {frames} "
                    f"to read before leaving: {item!r}"
                )
    return items


def fail_step(engine: Engine, at: int | None = None) -> int:
    """Make one step of a sim-runner engine fail: the runner's step number `at` (counted
    from 1 since the engine opened, failed steps included; by default the next step to
    start) raises `RunnerFailure`. Returns that step's number.

    What a failed step does: every sequence in that step ends with an `Error`
    (`RunnerFailure`, HTTP 500) and gives up its slot and KV cells; sequences not in the step
    carry on, and the engine keeps serving. Replaces any failure set before (including the
    config's `sim_fail_at_step`). To fail from the very first step, put
    `sim_fail_at_step=N` in the config instead.
    """
    runner = engine._runner
    if not isinstance(runner, SimRunner):
        raise TypeError(f"fail_step needs an engine on the sim runner, not {runner!r}")
    step = runner.steps + 1 if at is None else at
    if step <= runner.steps:
        raise ValueError(f"step {step} has already started (the runner is at step {runner.steps})")
    runner.fail_at_step = step
    return step


@contextlib.contextmanager
def garbage_cycles() -> Iterator[Callable[[], Counter[str]]]:
    """Within the block, the collector saves what it finds instead of freeing it; the function
    it yields collects and counts the Tributary objects among that (by class), that is those
    that reference counting did not free. A finished request should leave none:

        with testing.garbage_cycles() as cycles:
            ...  # requests
            assert cycles() == Counter()

    Enter it in the test's body once servers and engines are up, so only what the block does
    counts, and call `cycles()` inside the block (after it, it raises RuntimeError).
    """
    gc.collect()
    flags = gc.get_debug()
    saved = list(gc.garbage)  # whatever the program had kept there, given back afterwards
    gc.garbage.clear()
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    inside = True

    def count() -> Counter[str]:
        if not inside:
            raise RuntimeError("call cycles() inside the `with garbage_cycles()` block")
        gc.collect()
        return Counter(
            f"{type(o).__module__}.{type(o).__qualname__}"
            for o in gc.garbage
            if type(o).__module__.startswith("tributary.")
        )

    try:
        yield count
    finally:
        inside = False
        gc.set_debug(flags)
        gc.garbage[:] = saved
        gc.collect()
