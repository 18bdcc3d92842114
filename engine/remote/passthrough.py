"""`open_passthrough`: a request a front hands to one worker whole, and its answer as it comes.

Chat completions go this way. Their prompt is the messages rendered with the model's chat
template and tokenized by the model's tokenizer, and both stay on the workers (a template
that differs by one space changes the prompt without anyone noticing), so the front does
not render them: it picks a worker as for any item, sends the client's JSON body with the
worker's own model name, and relays the answer, as SGLang's gateway does. SGLang, vLLM,
llama.cpp's server and Tributary all serve `/v1/chat/completions`.

Synopsis::

    async with open_passthrough(upstream, "/v1/chat/completions", body, key=text) as answer:
        answer.status, answer.content_type     # the worker's
        async for chunk in answer.chunks: ...  # its body, as it arrives

Failure contract, as for forwarded items: before the worker has the request, a failure to
connect or to send it, or an OpenAI worker that does not name its model, is retried on
another worker, and so is an answer with a 408/429 or a 5xx status (at most `max_retries`
times, with the same backoff, never past `deadline`); then `WorkerFailure` with the last
status (503 if no worker was available). A connection that drops once the worker has the
request (its body written whole: `wire.SendTracker`), before its answer starts, is a 502
and a worker silent for `worker_timeout` a 504, never retried: the request may be what
killed the worker. Once an answer has started it is
the client's, whatever its status: a worker's 4xx is relayed as is. A connection the worker
breaks mid-answer raises a 502 `WorkerFailure` from `chunks` (504 if it went silent; the
caller ends its response with an error), and `read_whole` a 502 past `max_answer_bytes`;
`read_error` reads an error answer's body cut at `max_error_bytes` (never a failure).
Leaving the block closes the upstream response, which is how an OpenAI server learns that
its client left (SGLang and vLLM abort the request then).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from ..errors import WorkerFailure
from .attempt import NO_WORKER, Attempts
from .discovery import ModelUnknown
from .upstream import Upstream
from .wire import (
    AnswerTooLarge,
    counts_against_worker,
    error_message,
    is_retryable_status,
    read_error_body,
    read_limited,
)
from .worker import Worker

__all__ = ["Answer", "open_passthrough"]


@dataclasses.dataclass(frozen=True)
class Answer:
    """A worker's answer: its status and content type, and its body as it arrives."""

    status: int
    content_type: str
    chunks: AsyncIterator[bytes]
    worker: str  # the worker's URL (for logs and admins, never a client's message)
    #: The front's `max_answer_bytes` and `max_error_bytes`.
    max_bytes: int = 64 << 20
    max_error_bytes: int = 1 << 20

    async def read_whole(self) -> bytes:
        """The whole body, or a 502 `WorkerFailure` once it passes the front's
        `max_answer_bytes` (the rest is never read)."""
        chunks = self.chunks
        if isinstance(chunks, _Chunks):
            return await chunks.read_whole(self.max_bytes)
        try:
            return await read_limited(chunks, self.max_bytes)
        except AnswerTooLarge as exc:
            raise WorkerFailure(f"The worker's answer was given up: {exc}.", status=502) from None

    async def read_error(self) -> tuple[bytes, str | None]:
        """An error answer's body, cut at the front's `max_error_bytes` (the rest is never
        read: the status is what counts), and None if it came whole, else the message the
        cut body begins with (SGLang's, OpenAI's or vLLM's error shape, or its text)."""
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks:
            parts.append(chunk[: self.max_error_bytes - size])
            size += len(chunk)
            if size > self.max_error_bytes:
                cut = b"".join(parts)
                return cut, error_message(cut, self.status)
        return b"".join(parts), None


@asynccontextmanager
async def open_passthrough(
    upstream: Upstream,
    path: str,
    body: dict[str, Any],
    *,
    key: str | None,
    deadline: float = math.inf,
) -> AsyncIterator[Answer]:
    """POST `body` (its `model` replaced by the worker's) to `path` on a worker chosen by
    the fleet's policy for `key`; yield the first answer that is not a retryable failure."""
    config = upstream.config
    attempts = Attempts(upstream.fleet, config, key, deadline=deadline)
    failure = WorkerFailure(NO_WORKER, status=503)
    while (worker := await attempts.next()) is not None:
        with worker.attempt() as tracker:
            answered = False
            status: int | None = None  # a retryable status whose body is being read
            try:
                payload = {**body, "model": await upstream.model_of(worker)}
                stream = upstream.client.stream(
                    "POST", worker.url + path, json=payload, extensions=tracker.extensions
                )
                async with stream as response:
                    if is_retryable_status(response.status_code):
                        status = response.status_code
                        raw = await read_error_body(response, config.max_error_bytes)
                        failure = WorkerFailure(error_message(raw, status), status=status)
                        worker.errors_total += 1
                        worker.breaker.record_failure()
                        continue
                    answered = True
                    chunks = _Chunks(response, worker, upstream)
                    yield Answer(
                        response.status_code,
                        response.headers.get("content-type", "application/json"),
                        chunks,
                        worker.url,
                        max_bytes=config.max_answer_bytes,
                        max_error_bytes=config.max_error_bytes,
                    )
                    if chunks.broken:
                        pass  # counted where it broke; a success now would reset the breaker
                    elif counts_against_worker(response.status_code):
                        worker.breaker.record_failure()
                    else:
                        worker.breaker.record_success()
                    return
            except (httpx.HTTPError, ModelUnknown) as exc:
                if answered:  # the caller's own error: not the worker's, and never a retry
                    raise
                failure, reason = upstream.worker_failed(
                    worker, exc, sent=tracker.sent, started=False, status=status, what=path
                )
                if reason is not None:
                    # The worker had the request: it may be what broke the worker.
                    raise failure from None
    raise failure


class _Chunks:
    """The answer's body; a connection the worker breaks is a 502 `WorkerFailure` (a silent
    worker a 504; counted against it, and `broken` set), so the caller ends its own
    response cleanly."""

    def __init__(self, response: httpx.Response, worker: Worker, upstream: Upstream) -> None:
        self._bytes = response.aiter_bytes()
        self._worker = worker
        self._upstream = upstream
        self.broken = False

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._bytes.__anext__()
        except httpx.HTTPError as exc:
            raise self._broke(exc) from None

    async def read_whole(self, limit: int) -> bytes:
        try:
            return await read_limited(self, limit)
        except AnswerTooLarge as exc:
            raise self._broke(exc) from None

    def _broke(self, exc: Exception) -> WorkerFailure:
        self.broken = True
        failure, _ = self._upstream.worker_failed(
            self._worker, exc, sent=True, started=True, what="a relayed answer"
        )
        return failure
