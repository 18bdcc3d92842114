"""Streaming `/v1` responses: OpenAI chunks over SSE, always as deltas.

Each event is `data: <chunk json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`. What a
chunk holds is the endpoint's business (`ChunkRenderer`); the plumbing is `/generate`'s
`MultiplexedBody` (app/multiplex.py): whatever backlog is waiting rendered as one write,
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

from tributary.engine import Done, Error, Frame, RequestStream

from ..multiplex import MultiplexedBody, sse_response
from ..sse import DONE, sse_event
from .choices import Choice
from .errors import openai_error_object

__all__ = ["ChunkRenderer", "ChunkStreamBody", "chunk_stream_response"]


class ChunkRenderer(Protocol):
    def on_output(self, index: int, item: Frame | Done, choice: Choice) -> list[dict[str, Any]]:
        """Chunks for one engine item of choice `index` (`choice` already includes it)."""
        ...

    def on_end(self, choices: Sequence[Choice]) -> list[dict[str, Any]]:
        """Chunks after every choice finished, before `[DONE]` (the usage chunk)."""
        ...


def chunk_stream_response(streams: Sequence[RequestStream], renderer: ChunkRenderer) -> Response:
    return sse_response(ChunkStreamBody(streams, renderer))


class ChunkStreamBody(MultiplexedBody):
    def __init__(self, streams: Sequence[RequestStream], renderer: ChunkRenderer) -> None:
        self._renderer = renderer
        self._choices = [Choice(prompt_tokens=s.prompt_tokens) for s in streams]
        self._ended = False
        super().__init__(streams)

    async def __anext__(self) -> bytes:
        while not self._ended:
            backlog = await self.next_backlog()
            if backlog is None:
                self._ended = True
                return self._events(self._renderer.on_end(self._choices)) + DONE
            chunks: list[dict[str, Any]] = []
            for index, item in backlog:
                choice = self._choices[index]
                failure = choice.add(item)
                if failure is not None:
                    self._ended = True
                    return self._events([*chunks, openai_error_object(failure)]) + DONE
                assert not isinstance(item, Error)  # add() reports every Error as a failure
                chunks.extend(self._renderer.on_output(index, item, choice))
            if self.exhausted:  # the last terminal item: the end goes in the same write
                self._ended = True
                return self._events([*chunks, *self._renderer.on_end(self._choices)]) + DONE
            if chunks:
                return self._events(chunks)
        raise StopAsyncIteration

    @staticmethod
    def _events(chunks: list[dict[str, Any]]) -> bytes:
        return b"".join(sse_event(chunk) for chunk in chunks)
