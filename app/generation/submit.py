"""`submit_all`: how both APIs hand the engine the requests one body fans out into.

Ownership: it returns streams the caller must close (the views hand them to the exchange
with `owned_by_request` before anything can be cancelled).
"""

from __future__ import annotations

from collections.abc import Sequence

from tributary.engine import EngineService, GenerateRequest, QueueFull, RequestStream

from ..http.limits import Deadline

__all__ = ["submit_all"]


async def submit_all(
    engine: EngineService, items: Sequence[GenerateRequest], deadline: Deadline | None = None
) -> list[RequestStream]:
    """Prepare the items together (`engine.prepare`: their texts tokenized and grammars
    compiled in one go, off the event loop when that is more than a millisecond's work),
    then submit them all at once, before any is drained, so the scheduler batches them;
    each stream ends by `deadline` (a 408 abort) if one is given, and preparing past it is
    a `RequestTimedOut`.

    All or nothing: nothing is submitted until every item is prepared; if one submit raises
    (bad input, duplicate rid, QueueFull, ...), the items already submitted are aborted and
    the error propagates. A queue that cannot take every item refuses them all before any
    work (`prepare`'s QueueFull), and each is counted as refused; so are, on a queue that
    fills while they are prepared, the items after the refused one.
    """
    try:
        if deadline is None:
            items = await engine.prepare(items)
        else:
            with deadline.applied():
                items = await engine.prepare(items)
    except QueueFull:
        engine.count_refused(len(items))
        raise
    streams: list[RequestStream] = []
    try:
        for item in items:
            streams.append(engine.submit(item))
    except BaseException as exc:
        for stream in streams:
            stream.close()
        if isinstance(exc, QueueFull):
            engine.count_refused(len(items) - len(streams) - 1)
        raise
    if deadline is not None:
        deadline.bound(streams)
    return streams
