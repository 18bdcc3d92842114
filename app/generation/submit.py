"""`submit_all`: how both APIs hand the engine the requests one body fans out into;
`submit_owned`: the same for a view's request, the streams handed to its exchange.

Ownership: `submit_all` returns streams the caller must close (the views hand them to the
exchange with `owned_by_request` before anything can be cancelled); `submit_owned` does that
hand-over itself, before it returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from tributary.engine import BadRequest, EngineService, GenerateRequest, QueueFull, RequestStream

from ..chat.tools import ToolCalling
from ..http.errors import InvalidRequest
from ..http.limits import Deadline
from ..http.view import ViewRequest

__all__ = ["submit_all", "submit_owned"]


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


async def submit_owned(
    engine: EngineService,
    items: Sequence[GenerateRequest],
    request: ViewRequest,
    *,
    tools: ToolCalling | None = None,
    schemas: str = "",
) -> list[RequestStream]:
    """`submit_all` within `request`'s deadline, the streams appended to `request.owned` (the
    exchange closes them) before anything else can happen. A forced tool call (`tools`) whose
    grammar the engine cannot compile is a 400 naming `tools` and what the API calls the
    tools' schemas (`schemas`), not the engine's bare "Invalid json" one."""
    try:
        streams = await submit_all(engine, items, request.deadline)
    except BadRequest as exc:
        if tools is None or not tools.forced or not str(exc).startswith("Invalid json"):
            raise
        raise InvalidRequest(  # the schema is the tools' own: say so
            f"The tools' {schemas} do not compile into a forced-call grammar: {exc}",
            param="tools",
        ) from None
    request.owned.extend(streams)
    return streams
