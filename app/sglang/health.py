"""`SharedProbe`: at most one `/health_generate` probe in the engine; concurrent callers share
its verdict.

Synopsis::

    probe = SharedProbe(partial(_probe, engine, timeout))   # one per app
    ok = await probe()        # runs a probe, or waits for the one in flight and shares it

`/health_generate` needs no API key (Kubernetes probes carry none, as in SGLang), and each
probe is a request in the engine: a flood of them took running slots and queue places from
keyed clients (one such client's request took 1.8 s under a flood that cost 0.34 s as
`/health`). With this, a probe starts only when none is in flight; a caller that arrives
meanwhile waits for that probe and answers with its verdict, which was reached after the
caller arrived (a probe passes on output the engine produces after it started).

No task outlives its caller: the probe runs in the task of the caller that started it. If
that caller leaves (its client disconnected) before the verdict, the probe is cancelled and
one of the callers still waiting starts the next one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

__all__ = ["SharedProbe"]


class _Round:
    """One probe: its verdict (None until it has one, and for ever if it was cancelled)."""

    __slots__ = ("done", "verdict")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.verdict: bool | None = None


class SharedProbe:
    def __init__(self, probe: Callable[[], Awaitable[bool]]) -> None:
        self._probe = probe
        self._current: _Round | None = None
        #: Probes started (for tests and debugging).
        self.started = 0

    async def __call__(self) -> bool:
        while True:
            current = self._current
            if current is None:
                return await self._run()
            await current.done.wait()
            if current.verdict is not None:
                return current.verdict
            # Its caller left before the verdict: start (or join) the next probe.

    async def _run(self) -> bool:
        current = self._current = _Round()
        self.started += 1
        try:
            current.verdict = await self._probe()
            return current.verdict
        finally:
            self._current = None
            current.done.set()
