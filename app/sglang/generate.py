"""`/generate`: submit the normalized items, then drain them as one JSON object, a JSON array,
or an SSE stream.

Ownership: `submit_all` (app/generation) returns streams the caller must close;
`handle_generate` hands them to `cleanup` (closed when the HTTP exchange ends, however it
ends) before anything can be cancelled, and every drain also closes its streams when it
ends, however it ends. A client that disconnects cancels the handler (or the stream body),
which aborts every item at once, synchronously. Nothing polls for disconnects.

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
    TokenizerService,
    collect_redirected,
)

from ..generation import submit_all
from ..http.asgi import Owned
from ..http.errors import abort_status
from ..http.limits import Deadline
from ..http.responses import json_response
from ..observe.exchange import Exchange
from ..observe.timing import RequestTiming
from ..settings import ServerSettings
from .errors import error_object
from .normalize import normalize_generate
from .output import LogprobFormat, OutputAccumulator
from .stream import event_stream_response, refused_stream_response

__all__ = ["drain_batch", "drain_unary", "handle_generate"]


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
) -> tuple[int, dict[str, Any]]:
    """Read one item to its terminal output; return (HTTP status, response object).
    `timing` is this item's (`RequestTiming.for_item`); with `timing_detail` the answer's
    `meta_info` carries the request's phases too. The answer is built as the engine
    delivers each item, and this task wakes once, when the item has ended."""
    answer = _Answer(
        stream,
        timing,
        weight_version=weight_version,
        logprobs=logprobs,
        timing_detail=timing_detail,
    )
    async with stream:  # closing aborts it unless it has ended (a client that left)
        await collect_redirected([stream], lambda _index, item: answer.take(item))
    return answer.result()


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
    formats = logprobs or [None] * len(streams)

    async def drain_into(i: int) -> None:
        _status, results[i] = await drain_unary(
            streams[i],
            timings[i],
            weight_version=weight_version,
            logprobs=formats[i],
            timing_detail=timing_detail,
        )

    async with trio.open_nursery() as nursery:
        for i in range(len(streams)):
            nursery.start_soon(drain_into, i)
    return results


async def handle_generate(
    engine: EngineService,
    settings: ServerSettings,
    body: Any,
    cleanup: list[Owned],
    exchange: Exchange | None = None,
    *,
    tokenizer: TokenizerService,
    deadline: Deadline | None = None,
) -> Response:
    """Raises `engine.EngineError` for anything wrong before the first byte. `tokenizer`
    spells logprob tokens (`ServerState.capabilities.tokenizer`, looked up once).

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
    timings = [timing.for_item(s, item) for s, item in zip(streams, req.items, strict=True)]
    formats = logprob_formats(tokenizer, req.items, with_text=req.text_in_logprobs)
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
    tokenizer: TokenizerService, items: Sequence[GenerateRequest], *, with_text: bool
) -> list[LogprobFormat | None]:
    """How each item's logprobs are written (None: the item asked for none)."""

    def token_text(token: int) -> str:
        return tokenizer.detokenize([token], skip_special_tokens=False)

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
