"""`Forwarder`: the forwarding task of one submitted item, from the choice of a worker to
the item's last output.

Synopsis::

    forwarder = Forwarder(upstream, deliver=engine_deliver)
    nursery.start_soon(forwarder.forward, item)      # one task per item

It picks a worker (`attempt.Attempts`, excluding the ones already tried), POSTs the item
with its rid (SGLang's `/generate`, or OpenAI's `/v1/completions` with the worker's model)
and turns the worker's SSE frames into `Frame` / `Done` / `Error` outputs, handed to
`deliver` (the engine's: it ends the item on its terminal output). The failure contract is
`engine`'s module docstring: a try may be retried on another worker only before the item's
first output and while the worker never had the whole request
(`upstream.Upstream.worker_failed`). The task is cancelled by an abort (`Item.scope`), and
one try by the removal of its worker (`Item.attempt`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import trio

from ..errors import EngineError, WorkerFailure
from ..request import Done, Error, Output
from . import openai, sglang
from .attempt import NO_WORKER, Attempts
from .discovery import ModelUnknown
from .item import Item
from .upstream import Upstream
from .wire import (
    AnswerTooLarge,
    SSEPayloads,
    counts_against_worker,
    error_message,
    is_retryable_status,
    read_error_body,
)
from .worker import Worker

__all__ = ["Forwarder"]

LOGGER = logging.getLogger("tributary.engine.remote")

#: How long the rest of a worker's body (`[DONE]`, the chunked body's end) may take to come
#: once the item has its terminal frame, and how much of it the front reads.
_TRAILER_SECONDS = 1.0
_TRAILER_BYTES = 64 << 10


class Forwarder:
    """Forwards items to the workers of `upstream`; `deliver(item, output)` gets every
    output (it ignores those of an item that has ended)."""

    def __init__(self, upstream: Upstream, deliver: Callable[[Item, Output], None]) -> None:
        self.upstream = upstream
        self._deliver = deliver

    async def forward(self, item: Item) -> None:
        """The item's forwarding task: never raises but `Cancelled` (a bug ends the item
        with a 500, not the engine)."""
        with trio.CancelScope() as scope:
            item.scope = scope
            if item.ended:
                return
            try:
                await self._attempts(item)
            except Exception as exc:  # a bug here must end this item, not the engine
                LOGGER.exception("forwarding %s failed", item.rid)
                message = f"Internal error while forwarding the request ({type(exc).__name__})."
                self._deliver(item, Error(item.rid, WorkerFailure(message, status=500)))

    async def _attempts(self, item: Item) -> None:
        assert item.stream is not None
        attempts = Attempts(
            self.upstream.fleet,
            self.upstream.config,
            item.request.input_ids if item.request.input_ids is not None else item.request.text,
            deadline=item.stream.deadline,
            skip_kind="openai" if openai.unsupported_fields(item.request) else None,
            together=item.group,
        )
        failure: EngineError = WorkerFailure(NO_WORKER, status=503)
        while (worker := await attempts.next()) is not None:
            retry = await self._attempt(item, worker)
            if retry is None:
                return
            failure = retry
        lost = item.group.lost if item.group is not None else None
        if isinstance(lost, EngineError):
            failure = lost  # a sibling's worker had it and died: not tried elsewhere
        self._deliver(item, Error(item.rid, failure))

    async def _attempt(self, item: Item, worker: Worker) -> EngineError | None:
        """One try on `worker`. Returns the failure if the item may be retried elsewhere;
        None once the item has ended (or was aborted, which cancels this). A worker removed
        before the item's first output gives it up (`remove_worker` cancels the try): it is
        retried elsewhere if the worker did not have the whole request yet, else it ends
        with a 503 (a request a worker had is never handed to another)."""
        with trio.CancelScope() as scope:
            item.attempt = scope
            return await self._try(item, worker)
        if item.ended:
            return None  # cut while reading what followed its terminal item: nothing to retry
        self.upstream.abort_soon(worker, item.rid)
        if item.tracker is not None and item.tracker.sent:
            message = (
                f"Worker {worker.id} was removed from the fleet while it had the request; "
                "the request is not retried on another worker."
            )
            self._deliver(item, Error(item.rid, WorkerFailure(message, status=503)))
            return None
        return WorkerFailure(f"Worker {worker.id} was removed from the fleet.", status=503)

    async def _try(self, item: Item, worker: Worker) -> EngineError | None:
        item.worker = worker
        reader: sglang.GenerateStreamReader | openai.CompletionStreamReader | None = None
        status: int | None = None  # an error status whose body is being read
        upstream = self.upstream
        config = upstream.config
        with worker.attempt() as tracker:
            item.tracker = tracker
            try:
                if worker.kind == "openai":
                    model = await upstream.model_of(worker)
                    url = f"{worker.url}/v1/completions"
                    body = openai.completions_body(item.request, item.rid, model)
                    reader = openai.CompletionStreamReader(item.rid, item.request)
                else:
                    url = f"{worker.url}/generate"
                    body = sglang.generate_body(item.request, item.rid)
                    reader = sglang.GenerateStreamReader(item.rid)
                stream = upstream.client.stream(
                    "POST", url, json=body, extensions=tracker.extensions
                )
                async with stream as response:
                    if response.status_code != 200:
                        status = response.status_code
                        raw = await read_error_body(response, config.max_error_bytes)
                        return self._failed(
                            item, worker, status, error_message(raw, status), started=False
                        )
                    payloads = SSEPayloads(config.max_event_bytes)
                    chunks = response.aiter_bytes()
                    async for chunk in chunks:
                        for payload in payloads.feed(chunk):
                            if payload == b"[DONE]":
                                break
                            outcome = self._take(item, worker, reader, orjson.loads(payload))
                            if not isinstance(outcome, _More):
                                await _read_to_end(chunks)
                                return outcome
                        else:
                            continue
                        await _read_to_end(chunks)
                        break  # [DONE]
                if isinstance(reader, openai.CompletionStreamReader):
                    done = reader.done()
                    if done is not None:
                        self._deliver(item, done)
                        worker.breaker.record_success()
                        return None
                raise httpx.RemoteProtocolError("the stream ended without a terminal frame")
            except (
                httpx.HTTPError,
                ValueError,  # a frame that is not JSON
                KeyError,
                IndexError,
                AnswerTooLarge,
                ModelUnknown,  # before the request was sent: another worker may take it
            ) as exc:
                started = reader is not None and reader.started
                failure, reason = upstream.worker_failed(
                    worker, exc, sent=tracker.sent, started=started, status=status, what=item.rid
                )
                if reason is None:
                    return failure  # the worker never had the whole request: retried elsewhere
                if reason != "ended":
                    upstream.abort_soon(worker, item.rid)
                    if reason in ("dropped", "timeout") and item.group is not None:
                        # Its siblings would be lost the same way: none goes anywhere now.
                        item.group.lost = failure
                self._deliver(item, Error(item.rid, failure))
                return None
            finally:
                item.worker = None

    def _take(
        self,
        item: Item,
        worker: Worker,
        reader: sglang.GenerateStreamReader | openai.CompletionStreamReader,
        obj: Any,
    ) -> EngineError | _More | None:
        """One frame of the worker's: `_MORE` to read on, else what `_try` returns."""
        out = reader.read(obj)
        if out is None:
            return _MORE
        if isinstance(out, Error):
            status = out.error.http_status
            return self._failed(item, worker, status, out.error.message, started=reader.started)
        if isinstance(out, Done) and _worker_leaving(out) and not reader.started:
            # A worker shutting down refused it before any output: another may not.
            worker.errors_total += 1
            return WorkerFailure(str(out.finish_reason.get("message")), status=503)
        self._deliver(item, out)
        if isinstance(out, Done):
            worker.breaker.record_success()
            return None
        return _MORE

    def _failed(
        self, item: Item, worker: Worker, status: int, message: str, *, started: bool
    ) -> EngineError | None:
        """A worker's error answer (a status, or an error frame)."""
        error = WorkerFailure(message, status=status)
        if counts_against_worker(status):
            worker.errors_total += 1
            worker.breaker.record_failure()
        if is_retryable_status(status) and not started:
            return error
        self._deliver(item, Error(item.rid, error))
        return None


class _More:
    """`_take`'s answer for "the item goes on: read the next frame"."""


_MORE = _More()


async def _read_to_end(chunks: AsyncIterator[bytes]) -> None:
    """Read what follows the terminal frame so the connection goes back to the keep-alive
    pool: httpx closes a connection whose response was left unread, and every request would
    then open a new one. A worker that holds the stream open, or breaks it now, costs the
    item nothing: its answer is already delivered (and at most `_TRAILER_BYTES` are read)."""
    with trio.move_on_after(_TRAILER_SECONDS):
        read = 0
        try:
            async for chunk in chunks:
                read += len(chunk)
                if read > _TRAILER_BYTES:
                    return
        except httpx.HTTPError:
            pass


def _worker_leaving(done: Done) -> bool:
    reason = done.finish_reason
    return reason.get("type") == "abort" and reason.get("status_code") == 503
