"""Streaming `/generate`: SGLang's SSE framing over one or many engine streams.

Each event is `data: <json>\\n\\n`; the stream ends with one `data: [DONE]\\n\\n`.

- Cumulative mode (default): a frame carries all text and ids so far. Items that queued up
  while the client was reading are coalesced into one frame per request item.
- Incremental mode: every delta is its own frame; counts stay cumulative.
- The terminal frame of each item (finish_reason set) alone carries `e2e_latency`.
- A batch (or n > 1) interleaves its items' frames, each tagged with `index`.
- A failure (an `Error` item, or an abort carrying a status code) becomes an
  `{"error": {...}}` item, after any output not yet sent; the other items carry on.

Structure: `EventStreamBody` is a `MultiplexedBody` (app/multiplex.py): one pump task per
item, each item's timing recorded the moment the engine delivers, and whatever backlog is
waiting rendered as one chunk. Leaving the body early aborts every unfinished item.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quart import Response
from tributary.engine import Done, Error, Frame, Output, RequestStream

from .errors import abort_status, error_object
from .multiplex import MultiplexedBody, sse_response
from .output import OutputAccumulator, encode_json
from .timing import RequestTiming

__all__ = ["DONE", "EventStreamBody", "event_stream_response", "sse_event"]

DONE = b"data: [DONE]\n\n"


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
    return sse_response(
        EventStreamBody(
            streams, timing, batch=batch, incremental=incremental, weight_version=weight_version
        )
    )


class EventStreamBody(MultiplexedBody):
    def __init__(
        self,
        streams: Sequence[RequestStream],
        timing: RequestTiming,
        *,
        batch: bool,
        incremental: bool,
        weight_version: str,
    ) -> None:
        super().__init__(streams)
        self._timings = [timing.for_item() for _ in streams]
        self._accs = [
            OutputAccumulator(s.rid, s.prompt_tokens, weight_version=weight_version)
            for s in streams
        ]
        self._batch = batch
        self._incremental = incremental
        self._ended = False

    def on_item(self, index: int, item: Output) -> None:
        timing = self._timings[index]
        if not isinstance(item, Error):
            timing.observe_first_output()
        if isinstance(item, Done | Error):
            timing.finish()

    async def __anext__(self) -> bytes:
        while not self._ended:
            backlog = await self.next_backlog()
            if backlog is None:
                self._ended = True
                return DONE
            chunk = self._render(backlog)
            if chunk:
                return chunk
        raise StopAsyncIteration

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
