"""`/generate`: submit the normalized items, then drain them as one JSON object, a JSON array,
or an SSE stream.

Ownership: `submit_all` returns streams the caller must close; `handle_generate` hands them to
`cleanup` (closed when the HTTP exchange ends, however it ends) before anything can be
cancelled, and every drain also closes its streams when it ends, however it ends. A client
that disconnects cancels the handler (or the stream body), which aborts every item at once,
synchronously. Nothing polls for disconnects.

A unary answer is built as the engine delivers each item (`engine.collect_redirected`), so
its task wakes once, at the end, not once per token. A batch is a nursery with one such
drain task per item, its results collected by index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio
from quart import Response

from tributary.engine import (
    TERMINAL,
    Done,
    EngineService,
    Error,
    GenerateRequest,
    Output,
    QueueFull,
    RequestStream,
    collect_redirected,
)

from .asgi import Owned
from .errors import abort_status, error_object
from .exchange import Exchange
from .limits import Deadline
from .normalize import normalize_generate
from .output import LogprobFormat, OutputAccumulator, json_response
from .settings import ServerSettings
from .sse import event_stream_response, refused_stream_response
from .timing import RequestTiming

__all__ = ["drain_batch", "drain_unary", "handle_generate", "submit_all"]


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


class _Answer:
    """One item's unary answer, built at delivery (`take` runs in the engine's scheduler):
    its drain task wakes once, when the item has ended, not once per token."""

    def __init__(
        self,
        stream: RequestStream,
        timing: RequestTiming,
        *,
        weight_version: str,
        logprobs: LogprobFormat | None,
        timing_detail: bool,
    ) -> None:
        self.acc = OutputAccumulator(
            stream.rid, stream.prompt_tokens, weight_version=weight_version, logprobs=logprobs
        )
        self.timing = timing
        self.timing_detail = timing_detail
        self.end: Done | Error | None = None

    def take(self, item: Output) -> bool:
        if isinstance(item, TERMINAL):
            self.end = item
        if not isinstance(item, Error):
            self.acc.add(item)
        self.timing.observe(item)
        return False

    def result(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, response object)."""
        item = self.end
        if item is None:
            raise AssertionError("a RequestStream always ends with Done or Error")
        if isinstance(item, Error):
            return item.error.http_status, error_object(item.error.message, item.error.http_status)
        aborted = abort_status(item.finish_reason)
        if aborted is not None:
            return aborted[0], error_object(aborted[1], aborted[0])
        return 200, self.acc.cumulative(
            finish_reason=item.finish_reason,
            e2e_latency=self.timing.e2e_latency,
            timing=self.timing.detail() if self.timing_detail else None,
        )


async def drain_unary(
    stream: RequestStream,
    timing: RequestTiming,
    *,
    weight_version: str,
    logprobs: LogprobFormat | None = None,
    timing_detail: bool = False,
    count: bool = True,
) -> tuple[int, dict[str, Any]]:
    """Read one item to its terminal output; return (HTTP status, response object).
    `timing` is this item's (`RequestTiming.for_item`); with `timing_detail` the answer's
    `meta_info` carries the request's phases too. The answer is built as the engine
    delivers each item, and this task wakes once, when the item has ended. With `count`, a
    200 answer is counted in /metrics (`RequestTiming.count_answer`) once it is built."""
    answer = _Answer(
        stream,
        timing,
        weight_version=weight_version,
        logprobs=logprobs,
        timing_detail=timing_detail,
    )
    async with stream:  # closing aborts it unless it has ended (a client that left)
        await collect_redirected([stream], lambda _index, item: answer.take(item))
    status, obj = answer.result()
    if status == 200 and count:
        timing.count_answer()  # in /metrics: only an answer the client gets
    return status, obj


async def drain_batch(
    streams: Sequence[RequestStream],
    timings: Sequence[RequestTiming],
    *,
    weight_version: str,
    logprobs: Sequence[LogprobFormat | None] | None = None,
    timing_detail: bool = False,
) -> list[dict[str, Any]]:
    """Drain every item concurrently, each in its own task (`timings[i]` is item i's, and
    sees its terminal output the moment it arrives); results keep request order, failures
    are entries."""
    results: list[dict[str, Any]] = [{} for _ in streams]
    statuses = [0] * len(streams)
    formats = logprobs or [None] * len(streams)

    async def drain_into(i: int) -> None:
        statuses[i], results[i] = await drain_unary(
            streams[i],
            timings[i],
            weight_version=weight_version,
            logprobs=formats[i],
            timing_detail=timing_detail,
            count=False,
        )

    async with trio.open_nursery() as nursery:
        for i in range(len(streams)):
            nursery.start_soon(drain_into, i)
    for status, timing in zip(statuses, timings, strict=True):
        if status == 200:
            timing.count_answer()  # the whole array was built: its answers reach the client
    return results


async def handle_generate(
    engine: EngineService,
    settings: ServerSettings,
    body: Any,
    cleanup: list[Owned],
    exchange: Exchange | None = None,
    *,
    deadline: Deadline | None = None,
) -> Response:
    """Raises `engine.EngineError` for anything wrong before the first byte.

    `deadline` covers the whole request: an item still generating when it passes is aborted
    and reported as a 408 (a unary request's status; a batch item's entry, beside the items
    that finished; a stream's error item)."""
    req = normalize_generate(
        body,
        vocab_size=engine.model_info.vocab_size,
        max_items=engine.capacity,
        max_logprobs=settings.max_logprobs,
    )
    timing = RequestTiming.start(exchange)
    weight_version = settings.weight_version
    detail = settings.enable_request_timing
    try:
        streams = await submit_all(engine, req.items, deadline)
    except QueueFull as exc:
        if not req.stream:
            raise  # SGLang's 503 (errors.engine_error_response)
        return refused_stream_response(
            req.items,
            exc,
            timing,
            batch=req.is_batch,
            weight_version=weight_version,
            timing_detail=detail,
        )
    cleanup.extend(streams)
    # A streamed item is an answer once its terminal frame is out; a unary one only once the
    # whole response has been built without failing (the drains count it then).
    timings = [
        timing.for_item(s, item, count_on_done=req.stream)
        for s, item in zip(streams, req.items, strict=True)
    ]
    formats = logprob_formats(engine, req.items, with_text=req.text_in_logprobs)
    if req.stream:
        return event_stream_response(
            streams,
            timings,
            batch=req.is_batch,
            incremental=settings.incremental_streaming_output,
            weight_version=weight_version,
            logprobs=formats,
            timing_detail=detail,
        )
    if not req.is_batch:
        status, obj = await drain_unary(
            streams[0],
            timings[0],
            weight_version=weight_version,
            logprobs=formats[0],
            timing_detail=detail,
        )
        return json_response(obj, status=status)
    return json_response(
        await drain_batch(
            streams, timings, weight_version=weight_version, logprobs=formats, timing_detail=detail
        )
    )


def logprob_formats(
    engine: EngineService, items: Sequence[GenerateRequest], *, with_text: bool
) -> list[LogprobFormat | None]:
    """How each item's logprobs are written (None: the item asked for none)."""

    def token_text(token: int) -> str:
        return engine.detokenize([token], skip_special_tokens=False)

    return [
        None
        if item.logprobs is None
        else LogprobFormat(
            top=item.logprobs.top_n > 0,
            ids=item.logprobs.token_ids is not None,
            token_text=token_text if with_text else None,
        )
        for item in items
    ]
