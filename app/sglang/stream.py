"""Streaming `/generate`: SGLang's SSE framing over one or many engine streams.

Each event is `data: <json>\\n\\n`; the stream ends with one `data: [DONE]\\n\\n`.

- Cumulative mode (default): a frame carries all text and ids so far. Items that queued up
  while the client was reading are coalesced into one frame per request item. Logprobs are
  not resent: a non-terminal frame carries the output positions no earlier frame carried,
  the terminal frame all of them (output.py).
- Incremental mode: every delta is its own frame; counts stay cumulative.
- The terminal frame of each item (finish_reason set) alone carries `e2e_latency` (and, with
  `timing_detail`, the request's phases: `RequestTiming.detail`).
- A batch (or n > 1) interleaves its items' frames, each tagged with `index`.
- A failure (an `Error` item, or an abort carrying a status code) becomes an
  `{"error": {...}}` item, after any output not yet sent; the other items carry on.
- A request the queue cannot take (`QueueFull`) is still a 200 stream, as in SGLang: one
  terminal frame per item, empty, with an abort finish_reason carrying the status
  (`refused_stream_response`).

Structure: `EventStreamBody` is a `MultiplexedBody` (app/http/multiplex.py): each item's timing
recorded the moment the engine delivers, whatever backlog is waiting rendered as one chunk,
and `[DONE]` written with the last terminal frame. Leaving the body early aborts every
unfinished item.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from quart import Response
from quart.wrappers.response import DataBody

from tributary.engine import (
    EngineError,
    Error,
    Frame,
    GenerateRequest,
    Output,
    RequestStream,
)

from ..http.errors import abort_status
from ..http.multiplex import MultiplexedBody
from ..http.sse import DONE, sse_event, sse_response
from ..observe.timing import RequestTiming
from .errors import error_object
from .output import LogprobFormat, OutputAccumulator, output_object

__all__ = [
    "EventStreamBody",
    "event_stream_response",
    "refused_stream_response",
]


def event_stream_response(
    streams: Sequence[RequestStream],
    timing: RequestTiming | Sequence[RequestTiming],
    *,
    batch: bool,
    incremental: bool,
    weight_version: str,
    logprobs: Sequence[LogprobFormat | None] | None = None,
    timing_detail: bool = False,
) -> Response:
    return sse_response(
        EventStreamBody(
            streams,
            timing,
            batch=batch,
            incremental=incremental,
            weight_version=weight_version,
            logprobs=logprobs,
            timing_detail=timing_detail,
        )
    )


def refused_stream_response(
    items: Sequence[GenerateRequest],
    error: EngineError,
    timing: RequestTiming,
    *,
    batch: bool,
    weight_version: str,
    timing_detail: bool = False,
) -> Response:
    """SGLang's stream for requests refused before they ran (a full queue): its scheduler
    aborts each one with the status in the finish_reason, and the stream passes that abort on
    as an ordinary terminal frame, so the HTTP status is 200. Nothing was submitted.

    Each item is an answer carrying `e2e_latency`, so /metrics counts it as one."""
    reason = {
        "type": "abort",
        "message": error.message,
        "status_code": error.http_status,
        "err_type": None,
    }
    frames = []
    for i, item in enumerate(items):
        refused = timing.for_item(request=item)
        refused.rid = item.rid if item.rid is not None else uuid.uuid4().hex
        refused.refused(reason)
        frame = output_object(
            rid=refused.rid,
            text="",
            output_ids=[],
            prompt_tokens=0,
            completion_tokens=0,
            cached_tokens=0,
            finish_reason=reason,
            weight_version=weight_version,
            e2e_latency=refused.e2e_latency,
            index=i if batch else None,
            timing=refused.detail() if timing_detail else None,  # all null: it never ran
        )
        frames.append(sse_event(frame))
    return sse_response(DataBody(b"".join([*frames, DONE])))


class EventStreamBody(MultiplexedBody):
    def __init__(
        self,
        streams: Sequence[RequestStream],
        timing: RequestTiming | Sequence[RequestTiming],
        *,
        batch: bool,
        incremental: bool,
        weight_version: str,
        logprobs: Sequence[LogprobFormat | None] | None = None,
        timing_detail: bool = False,
    ) -> None:
        """`timing`: one per stream (`RequestTiming.for_item`), or the request's, from which
        each stream gets its own."""
        # Set before super().__init__, which delivers the items already waiting.
        self._timings = (
            [timing.for_item(s) for s in streams]
            if isinstance(timing, RequestTiming)
            else list(timing)
        )
        self._timing_detail = timing_detail
        self._accs = [
            OutputAccumulator(s.rid, s.prompt_tokens, weight_version=weight_version, logprobs=fmt)
            for s, fmt in zip(streams, logprobs or [None] * len(streams), strict=True)
        ]
        self._batch = batch
        self._incremental = incremental
        self._ended = False
        super().__init__(streams)

    def on_item(self, index: int, item: Output) -> None:
        self._timings[index].observe(item)

    renders_frames = True

    def render_frame(self, index: int, item: Frame) -> bytes:
        return self._render([(index, item)])

    async def next_chunk(self) -> bytes:
        while not self._ended:
            backlog = await self.next_backlog()
            if backlog is None:
                self._ended = True
                return DONE
            chunk = self._render(backlog)
            if self.exhausted:  # the last terminal item: [DONE] goes in the same write
                self._ended = True
                return chunk + DONE
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
                    out.append(sse_event(acc.cumulative(index=tag, frame=True)))
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
                        else acc.cumulative(index=tag, frame=True)
                    )
                    out.append(sse_event(pending))
                out.append(sse_event(error_object(aborted[1], aborted[0], index=tag)))
                continue
            timing = self._timings[index]
            latency = timing.e2e_latency
            detail = timing.detail() if self._timing_detail else None
            reason = item.finish_reason
            final = (
                acc.delta(item, finish_reason=reason, e2e_latency=latency, index=tag, timing=detail)
                if self._incremental
                else acc.cumulative(
                    finish_reason=reason, e2e_latency=latency, index=tag, timing=detail
                )
            )
            out.append(sse_event(final))
        for index in unsent:
            out.append(sse_event(self._accs[index].cumulative(index=self._tag(index), frame=True)))
        return b"".join(out)

    def _tag(self, index: int) -> int | None:
        return index if self._batch else None
