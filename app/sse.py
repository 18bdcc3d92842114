"""Streaming `/generate`: SGLang's SSE framing over one or many engine streams.

Each event is `data: <json>\\n\\n`; the stream ends with one `data: [DONE]\\n\\n`.

- Cumulative mode (default): a frame carries all text and ids so far. Items that queued up
  while the client was reading are coalesced into one frame per request item.
- Incremental mode: every delta is its own frame; counts stay cumulative.
- The terminal frame of each item (finish_reason set) alone carries `e2e_latency`.
- A batch (or n > 1) interleaves its items' frames, each tagged with `index`.
- A failure (an `Error` item, or an abort carrying a status code) becomes an
  `{"error": {...}}` item, after any output not yet sent; the other items carry on.

Structure: `EventStreamBody` is a Quart `ResponseBody`. Quart drives it as
`async with body: async for chunk in body: send(chunk)`, so the nursery opened in
`__aenter__` and closed in `__aexit__` nests properly in the responding task (an async
generator holding a nursery across `yield` would not). One pump task per item moves engine
items into a single channel, recording each item's timing the moment the engine delivers; the
iterator renders whatever backlog is waiting as one chunk. Leaving the body early (client
gone: `Cancelled`) cancels the pumps and aborts every unfinished item synchronously.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import trio
from quart import Response
from quart.wrappers.response import ResponseBody

from engine import Done, Error, Frame, Output, RequestStream
from engine.service_nursery import open_service_nursery

from .errors import abort_status, error_object
from .output import OutputAccumulator, encode_json
from .timing import RequestTiming

__all__ = ["DONE", "EventStreamBody", "event_stream_response", "sse_event"]

DONE = b"data: [DONE]\n\n"

# Proxies (nginx) buffer responses unless told otherwise; a buffered token stream is useless.
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(obj: Any) -> bytes:
    return f"data: {encode_json(obj)}\n\n".encode()


def event_stream_response(
    streams: Sequence[RequestStream],
    timing: RequestTiming,
    *,
    batch: bool,
    incremental: bool,
    weight_version: str,
) -> Response:
    body = EventStreamBody(
        streams, timing, batch=batch, incremental=incremental, weight_version=weight_version
    )
    response = Response(body, mimetype="text/event-stream", headers=_HEADERS)
    # Quart-Trio cuts any response after RESPONSE_TIMEOUT (60 s) without a word; a long
    # generation is not a stuck one.
    response.timeout = None
    return response


class EventStreamBody(ResponseBody):
    def __init__(
        self,
        streams: Sequence[RequestStream],
        timing: RequestTiming,
        *,
        batch: bool,
        incremental: bool,
        weight_version: str,
    ) -> None:
        self._streams = list(streams)
        self._timings = [timing.for_item() for _ in streams]
        self._accs = [
            OutputAccumulator(s.rid, s.prompt_tokens, weight_version=weight_version)
            for s in streams
        ]
        self._batch = batch
        self._incremental = incremental
        self._send, self._recv = trio.open_memory_channel[tuple[int, Output]](math.inf)
        self._nursery_cm = open_service_nursery()
        self._nursery: trio.Nursery | None = None
        self._ended = False

    async def __aenter__(self) -> EventStreamBody:
        self._nursery = await self._nursery_cm.__aenter__()
        async with self._send:
            for index, stream in enumerate(self._streams):
                self._nursery.start_soon(self._pump, index, stream, self._send.clone())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._nursery is not None
        # Cancel first: a pump blocked in receive must see Cancelled, not the
        # ClosedResourceError that closing its stream under it would raise.
        self._nursery.cancel_scope.cancel()
        for stream in self._streams:
            stream.close()
        self._recv.close()
        await self._nursery_cm.__aexit__(exc_type, exc, tb)

    def __aiter__(self) -> EventStreamBody:
        return self

    async def __anext__(self) -> bytes:
        while not self._ended:
            try:
                backlog = [await self._recv.receive()]
            except trio.EndOfChannel:
                self._ended = True
                return DONE
            while True:
                try:
                    backlog.append(self._recv.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            chunk = self._render(backlog)
            if chunk:
                return chunk
        raise StopAsyncIteration

    async def _pump(
        self, index: int, stream: RequestStream, send: trio.MemorySendChannel[tuple[int, Output]]
    ) -> None:
        timing = self._timings[index]
        async with send, stream:
            async for item in stream:
                if not isinstance(item, Error):
                    timing.observe_first_output()
                if isinstance(item, Done | Error):
                    timing.finish()
                send.send_nowait((index, item))

    def _render(self, backlog: list[tuple[int, Output]]) -> bytes:
        out: list[bytes] = []
        # Cumulative mode: items with frames folded in but not sent yet, in arrival order.
        unsent: dict[int, None] = {}
        for index, item in backlog:
            acc = self._accs[index]
            tag = self._tag(index)
            was_unsent = index in unsent
            unsent.pop(index, None)
            if isinstance(item, Error):
                if was_unsent:
                    out.append(sse_event(acc.cumulative(index=tag)))
                err = item.error
                out.append(sse_event(error_object(err.message, err.http_status, index=tag)))
                continue
            acc.add(item)
            if isinstance(item, Frame):
                if self._incremental:
                    out.append(sse_event(acc.delta(item, index=tag)))
                else:
                    unsent[index] = None
                continue
            had_unsent = was_unsent or bool(item.output_ids or item.text)
            aborted = abort_status(item.finish_reason)
            if aborted is not None:
                if had_unsent:  # output before the failure still reaches the client
                    pending = (
                        acc.delta(item, index=tag)
                        if self._incremental
                        else acc.cumulative(index=tag)
                    )
                    out.append(sse_event(pending))
                out.append(sse_event(error_object(aborted[1], aborted[0], index=tag)))
                continue
            latency = self._timings[index].e2e_latency
            reason = item.finish_reason
            final = (
                acc.delta(item, finish_reason=reason, e2e_latency=latency, index=tag)
                if self._incremental
                else acc.cumulative(finish_reason=reason, e2e_latency=latency, index=tag)
            )
            out.append(sse_event(final))
        for index in unsent:
            out.append(sse_event(self._accs[index].cumulative(index=self._tag(index))))
        return b"".join(out)

    def _tag(self, index: int) -> int | None:
        return index if self._batch else None
