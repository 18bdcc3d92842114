"""The engine's scheduler: continuous batching over one runner, in one task.

Synopsis::

    scheduler = Scheduler(runner, config, kv_total_cells=config.kv_cells(context_length))
    await nursery.start(scheduler.run)      # the task that owns every sequence
    scheduler.enqueue(seq)                  # from any task; never blocks
    scheduler.mark_abort(seq, reason)       # likewise: acted on at the next step boundary

Its rooms: `loop` (`Scheduler`: admission, the step loop, commit), `planner` (what each
step computes, runs and bursts), `kv_reuse` (the prefix cache and forks of parallel
samples), `sequence` (`Sequence`: one request inside the engine, and its stop rules).
"""

from .loop import Scheduler as Scheduler
from .sequence import Sequence as Sequence
