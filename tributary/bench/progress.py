"""A progress bar on stderr while the requests run (rich, from the `bench` extra).

Rich draws from a refresh thread by default; here a Trio task refreshes it four times a second
instead, so the client has no thread of its own competing with the server for the cores.
Without rich (or with `enabled=False`) the bar is a no-op.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

__all__ = ["ProgressBar", "open_progress"]

REFRESH_INTERVAL = 0.25


class ProgressBar:
    def __init__(self, progress: Any = None, task: Any = None) -> None:
        self._progress = progress
        self._task = task
        self.failed = 0

    def advance(self, *, ok: bool) -> None:
        if not ok:
            self.failed += 1
        if self._progress is not None:
            self._progress.update(self._task, advance=1, failed=self.failed)


@asynccontextmanager
async def open_progress(
    total: int, *, description: str, enabled: bool = True
) -> AsyncIterator[ProgressBar]:
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
    except ImportError:
        enabled = False
    if not enabled:
        yield ProgressBar()
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("[red]{task.fields[failed]} failed"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        auto_refresh=False,
        transient=False,
    )
    with progress:
        task = progress.add_task(description, total=total, failed=0)
        async with trio.open_nursery() as nursery:

            async def refresh() -> None:
                while True:
                    progress.refresh()
                    await trio.sleep(REFRESH_INTERVAL)

            nursery.start_soon(refresh)
            try:
                yield ProgressBar(progress, task)
            finally:
                nursery.cancel_scope.cancel()
        progress.refresh()
