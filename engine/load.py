"""What a local engine holds, read from its scheduler: the load a router balances on
(`EngineLoad`) and what requests still hold for leak checks (`IdleReport`).

Synopsis::

    load = current_load(scheduler, runner)           # Engine.load(): SGLang's /get_load
    report = idle_report(scheduler, runner, rids=tuple(live), scheduler_alive=True)
    assert report.idle

Both are snapshots taken on the event loop between steps; neither waits nor changes anything.
"""

from __future__ import annotations

import dataclasses

from .interface import EngineLoad
from .runners.base import Runner
from .scheduler import Scheduler

__all__ = ["IdleReport", "current_load", "idle_report"]


@dataclasses.dataclass(frozen=True)
class IdleReport:
    """What an engine still holds (`Engine.idle_report`): all zero and empty when idle."""

    running: int  # sequences admitted to a runner slot (aborted ones until they are reaped)
    waiting: int  # submitted, not yet admitted
    kv_used_cells: int  # as the runner counts them
    slots_held: int  # runner slots not back in the free list
    rids: tuple[str, ...]  # request ids still in flight (not yet ended or aborted)
    cache_pins: int  # prefix cache entries held for restores not yet run
    # The scheduler task is still running. False once it has ended: the engine has closed,
    # or its scheduler died (an engine that can no longer serve is not idle, it is broken).
    scheduler_alive: bool

    @property
    def idle(self) -> bool:
        return self.scheduler_alive and not (
            self.running
            or self.waiting
            or self.kv_used_cells
            or self.slots_held
            or self.rids
            or self.cache_pins
        )


def current_load(scheduler: Scheduler, runner: Runner) -> EngineLoad:
    """What SGLang's `/get_load` reports, from the scheduler's live state: a request
    whose client left stops counting at once (its sequence is marked), and its KV cells
    at the next step boundary, when they are freed."""
    waiting = len(scheduler.waiting)
    running = sum(1 for seq in scheduler.running if seq.abort is None)
    queued_tokens = sum(len(seq.prompt_ids) for seq in scheduler.waiting)
    return EngineLoad(
        num_reqs=running + waiting,
        num_waiting_reqs=waiting,
        num_tokens=runner.kv_used_cells() + queued_tokens,
    )


def idle_report(
    scheduler: Scheduler, runner: Runner, *, rids: tuple[str, ...], scheduler_alive: bool
) -> IdleReport:
    """What the scheduler and runner still hold, with the engine's in-flight `rids` and
    whether its scheduler task still runs (see `Engine.idle_report`)."""
    return IdleReport(
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        kv_used_cells=runner.kv_used_cells(),
        slots_held=scheduler.max_running - len(scheduler._free_slots),
        rids=rids,
        cache_pins=scheduler.prefix_cache.pins if scheduler.prefix_cache is not None else 0,
        scheduler_alive=scheduler_alive,
    )
