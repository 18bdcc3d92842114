"""`MultiplexedBody`: several engine streams read as one SSE response body.

Synopsis::

    class MyBody(MultiplexedBody):
        async def __anext__(self) -> bytes:
            backlog = await self.next_backlog()    # [(item index, Output), ...] or None at end
            ...

Quart drives a `ResponseBody` as `async with body: async for chunk in body: send(chunk)`, so
the nursery opened in `__aenter__` and closed in `__aexit__` nests properly in the responding
task (an async generator holding a nursery across `yield` would not). One pump task per
stream moves engine items into a single channel as the engine delivers them; `next_backlog`
returns everything waiting, so a slow reader gets one coalesced write instead of many.
Leaving the body early (client gone: `Cancelled`, or `GeneratorExit`) cancels the pumps and
aborts every unfinished request synchronously.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from types import TracebackType

import trio
from quart import Response
from quart.wrappers.response import ResponseBody

from tributary.engine import Output, RequestStream
from tributary.engine.service_nursery import open_service_nursery

__all__ = ["MultiplexedBody", "sse_response"]

# Proxies (nginx) buffer responses unless told otherwise; a buffered token stream is useless.
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response(body: ResponseBody) -> Response:
    response = Response(body, mimetype="text/event-stream", headers=_HEADERS)
    # Quart-Trio cuts any response after RESPONSE_TIMEOUT (60 s) without a word; a long
    # generation is not a stuck one.
    response.timeout = None
    return response


class MultiplexedBody(ResponseBody):
    def __init__(self, streams: Sequence[RequestStream]) -> None:
        self._streams = list(streams)
        self._send, self._recv = trio.open_memory_channel[tuple[int, Output]](math.inf)
        self._nursery_cm = open_service_nursery()
        self._nursery: trio.Nursery | None = None

    def on_item(self, index: int, item: Output) -> None:
        """Called in the pump the moment the engine delivers `item` (for timing)."""

    async def next_backlog(self) -> list[tuple[int, Output]] | None:
        """Wait for at least one item; return all that are waiting, or None once every
        stream has ended."""
        try:
            backlog = [await self._recv.receive()]
        except trio.EndOfChannel:
            return None
        while True:
            try:
                backlog.append(self._recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                return backlog

    async def __aenter__(self) -> MultiplexedBody:
        self._nursery = await self._nursery_cm.__aenter__()
        async with self._send:
            for index, stream in enumerate(self._streams):
                self._nursery.start_soon(self._pump, index, stream, self._send.clone())
        return self

    # Quart types this as returning None; a context manager may return a bool.
    async def __aexit__(  # type: ignore[override]
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._nursery is not None
        # Cancel first: a pump blocked in receive must see Cancelled, not the
        # ClosedResourceError that closing its stream under it would raise.
        self._nursery.cancel_scope.cancel()
        for stream in self._streams:
            stream.close()
        self._recv.close()
        return await self._nursery_cm.__aexit__(exc_type, exc, tb)

    def __aiter__(self) -> MultiplexedBody:
        return self

    @abstractmethod
    async def __anext__(self) -> bytes:
        """The next chunk to send; subclasses render `next_backlog()`."""

    async def _pump(
        self, index: int, stream: RequestStream, send: trio.MemorySendChannel[tuple[int, Output]]
    ) -> None:
        async with send, stream:
            async for item in stream:
                self.on_item(index, item)
                send.send_nowait((index, item))
