"""Streaming `/v1` responses: OpenAI chunks over SSE, always as deltas.

Each event is `data: <chunk json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`. What a
chunk holds is the endpoint's business (`ChunkRenderer`); the plumbing is `/generate`'s
`MultiplexedBody` (app/http/multiplex.py): whatever backlog is waiting rendered as one write,
and the end (usage chunk, `[DONE]`) written with the last choice's final chunk.

`--incremental-streaming-output` does not apply: OpenAI clients concatenate deltas, so `/v1`
always sends deltas (as SGLang does).

Failures: the first `Error` item (or an abort carrying a status code) becomes one
`{"error": {...}}` event followed by `[DONE]`, and the other choices are aborted; the
`openai` client raises it as an `APIError`. Leaving the body early (client gone: `Cancelled`,
or `GeneratorExit`) aborts every unfinished request synchronously.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from quart import Response

from tributary.engine import Done, Error, Frame, Output, RequestStream

from ..http.multiplex import MultiplexedBody
from ..http.sse import DONE, sse_event, sse_response
from ..observe.timing import RequestTiming
from .choices import Choice
from .errors import openai_error_object
from .timings import llama_timings

__all__ = ["ChunkRenderer", "ChunkStreamBody", "chunk_stream_response"]


class ChunkRenderer(Protocol):
    #: A last chunk with the usage follows every choice's end (`on_end`).
    include_usage: bool

    def on_output(self, index: int, item: Frame | Done, choice: Choice) -> list[dict[str, Any]]:
        """Chunks for one engine item of choice `index` (`choice` already includes it)."""
        ...

    def on_end(self, choices: Sequence[Choice]) -> list[dict[str, Any]]:
        """Chunks after every choice finished, before `[DONE]` (the usage chunk)."""
        ...


def chunk_stream_response(
    streams: Sequence[RequestStream],
    renderer: ChunkRenderer,
    timings: Sequence[RequestTiming] | None = None,
    *,
    timing_detail: bool = False,
) -> Response:
    return sse_response(ChunkStreamBody(streams, renderer, timings, timing_detail=timing_detail))


class ChunkStreamBody(MultiplexedBody):
    """`timings[i]` (when given) observes choice i's items; with `timing_detail`, the usage
    chunk, or without one the last choice's finishing chunk, carries `timings`."""

    def __init__(
        self,
        streams: Sequence[RequestStream],
        renderer: ChunkRenderer,
        timings: Sequence[RequestTiming] | None = None,
        *,
        timing_detail: bool = False,
    ) -> None:
        self._renderer = renderer
        self._choices = [Choice(prompt_tokens=s.prompt_tokens) for s in streams]
        self._timings = list(timings) if timings is not None else None
        self._timing_detail = timing_detail and self._timings is not None
        self._ended = False
        super().__init__(streams)

    def on_item(self, index: int, item: Output) -> None:
        if self._timings is not None:
            self._timings[index].observe(item)

    def _attach_timings(self, chunks: list[dict[str, Any]]) -> None:
        if self._timing_detail and chunks and self._timings is not None:
            chunks[-1]["timings"] = llama_timings(self._timings)

    def _end(self) -> list[dict[str, Any]]:
        """The chunks after every choice finished (the usage chunk, carrying `timings`)."""
        end = self._renderer.on_end(self._choices)
        self._attach_timings(end)
        return end

    renders_frames = True

    def render_frame(self, index: int, item: Frame) -> bytes:
        choice = self._choices[index]
        choice.add(item)  # a Frame never reports a failure
        return self._events(self._renderer.on_output(index, item, choice))

    async def next_chunk(self) -> bytes:
        while not self._ended:
            backlog = await self.next_backlog()
            if backlog is None:
                self._ended = True
                return self._events(self._end()) + DONE
            chunks: list[dict[str, Any]] = []
            for index, item in backlog:
                choice = self._choices[index]
                failure = choice.add(item)
                if failure is not None:
                    self._ended = True
                    return self._events([*chunks, openai_error_object(failure)]) + DONE
                assert not isinstance(item, Error)  # add() reports every Error as a failure
                rendered = self._renderer.on_output(index, item, choice)
                if choice.called and self._timings is not None:
                    self._timings[index].called_tools = True
                if (
                    isinstance(item, Done)
                    and not self._renderer.include_usage
                    and all(c.finish_reason is not None for c in self._choices)
                ):
                    self._attach_timings(rendered)
                chunks.extend(rendered)
            if self.exhausted:  # the last terminal item: the end goes in the same write
                self._ended = True
                return self._events([*chunks, *self._end()]) + DONE
            if chunks:
                return self._events(chunks)
        raise StopAsyncIteration

    @staticmethod
    def _events(chunks: list[dict[str, Any]]) -> bytes:
        return b"".join(sse_event(chunk) for chunk in chunks)
