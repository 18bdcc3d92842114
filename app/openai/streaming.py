"""Streaming `/v1` responses: OpenAI chunks over SSE, always as deltas.

Each event is `data: <chunk json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`. What a
chunk holds is the endpoint's business (`ChunkRenderer`); this module owns the plumbing,
built like `/generate`'s `EventStreamBody`: a Quart `ResponseBody` whose nursery (opened in
`__aenter__`, closed in `__aexit__`) runs one pump task per choice, moving engine items into
one channel; the iterator renders whatever backlog is waiting as one write.

`--incremental-streaming-output` does not apply: OpenAI clients concatenate deltas, so `/v1`
always sends deltas (as SGLang does).

Failures: the first `Error` item (or an abort carrying a status code) becomes one
`{"error": {...}}` event followed by `[DONE]`, and the other choices are aborted; the
`openai` client raises it as an `APIError`. Leaving the body early (client gone: `Cancelled`,
or `GeneratorExit`) cancels the pumps and aborts every unfinished request synchronously.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Protocol

import trio
from quart import Response
from quart.wrappers.response import ResponseBody

from engine import Done, Error, Frame, Output, RequestStream
from engine.service_nursery import open_service_nursery

from ..sse import DONE, sse_event
from .choices import Choice
from .errors import openai_error_object

__all__ = ["ChunkRenderer", "ChunkStreamBody", "chunk_stream_response"]

# Proxies (nginx) buffer responses unless told otherwise; a buffered token stream is useless.
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ChunkRenderer(Protocol):
    def on_output(self, index: int, item: Frame | Done, choice: Choice) -> list[dict[str, Any]]:
        """Chunks for one engine item of choice `index` (`choice` already includes it)."""
        ...

    def on_end(self, choices: Sequence[Choice]) -> list[dict[str, Any]]:
        """Chunks after every choice finished, before `[DONE]` (the usage chunk)."""
        ...


def chunk_stream_response(streams: Sequence[RequestStream], renderer: ChunkRenderer) -> Response:
    response = Response(
        ChunkStreamBody(streams, renderer), mimetype="text/event-stream", headers=_HEADERS
    )
    # Quart-Trio cuts any response after RESPONSE_TIMEOUT (60 s) without a word; a long
    # generation is not a stuck one.
    response.timeout = None
    return response


class ChunkStreamBody(ResponseBody):
    def __init__(self, streams: Sequence[RequestStream], renderer: ChunkRenderer) -> None:
        self._streams = list(streams)
        self._renderer = renderer
        self._choices = [Choice(prompt_tokens=s.prompt_tokens) for s in streams]
        self._send, self._recv = trio.open_memory_channel[tuple[int, Output]](math.inf)
        self._nursery_cm = open_service_nursery()
        self._nursery: trio.Nursery | None = None
        self._ended = False

    async def __aenter__(self) -> ChunkStreamBody:
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

    def __aiter__(self) -> ChunkStreamBody:
        return self

    async def __anext__(self) -> bytes:
        while not self._ended:
            try:
                backlog = [await self._recv.receive()]
            except trio.EndOfChannel:
                self._ended = True
                return self._events(self._renderer.on_end(self._choices)) + DONE
            while True:
                try:
                    backlog.append(self._recv.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            chunks: list[dict[str, Any]] = []
            for index, item in backlog:
                choice = self._choices[index]
                failure = choice.add(item)
                if failure is not None:
                    self._ended = True
                    return self._events([*chunks, openai_error_object(failure)]) + DONE
                assert not isinstance(item, Error)  # add() reports every Error as a failure
                chunks.extend(self._renderer.on_output(index, item, choice))
            if chunks:
                return self._events(chunks)
        raise StopAsyncIteration

    @staticmethod
    def _events(chunks: list[dict[str, Any]]) -> bytes:
        return b"".join(sse_event(chunk) for chunk in chunks)

    @staticmethod
    async def _pump(
        index: int, stream: RequestStream, send: trio.MemorySendChannel[tuple[int, Output]]
    ) -> None:
        async with send, stream:
            async for item in stream:
                send.send_nowait((index, item))
