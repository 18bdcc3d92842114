"""A nursery for long-lived services that surfaces a lone error as itself.

Synopsis::

    async with open_service_nursery() as nursery:
        await nursery.start(scheduler.run)
        yield engine                     # a KeyError raised here reaches the caller as KeyError

Trio's strict exception groups wrap even a single error raised in a nursery's body. For a
context manager that owns a nursery around its `yield`, that would turn every error of the
caller's block into an ExceptionGroup; trio's own `as_safe_channel` unwraps in the same way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

__all__ = ["open_service_nursery"]


@asynccontextmanager
async def open_service_nursery() -> AsyncIterator[trio.Nursery]:
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
