"""`open_passthrough`: a request a front hands to one worker whole, and its answer as it comes.

Chat completions go this way. Their prompt is the messages rendered with the model's chat
template and tokenized by the model's tokenizer, and both stay on the workers (a template
that differs by one space changes the prompt without anyone noticing), so the front does
not render them: it picks a worker as for any item, sends the client's JSON body with the
worker's own model name, and relays the answer, as SGLang's gateway does. SGLang, vLLM,
llama.cpp's server and Tributary all serve `/v1/chat/completions`.

Synopsis::

    async with open_passthrough(engine, "/v1/chat/completions", body, key=text) as answer:
        answer.status, answer.content_type     # the worker's
        async for chunk in answer.chunks: ...  # its body, as it arrives

Failure contract, as for forwarded items: before the worker's answer starts, a connection
failure, a 408/429 or a 5xx is retried on another worker (at most `max_retries` times, with
the same backoff, never past `deadline`); then `WorkerFailure` with the last status (503 if
no worker was available). Once an answer has started it is the client's, whatever its
status: a worker's 4xx is relayed as is. A connection the worker breaks mid-answer raises a
502 `WorkerFailure` from `chunks` (the caller ends its response with an error). Leaving the
block closes the upstream response, which is how an OpenAI server learns that its client
left (SGLang and vLLM abort the request then).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import httpx

from ..errors import WorkerFailure
from .fleet import Attempts, Worker
from .wire import counts_against_worker, error_message, is_retryable_status

if TYPE_CHECKING:
    from .engine import RemoteEngine

__all__ = ["Answer", "open_passthrough"]


@dataclasses.dataclass(frozen=True)
class Answer:
    """A worker's answer: its status and content type, and its body as it arrives."""

    status: int
    content_type: str
    chunks: AsyncIterator[bytes]
    worker: str  # the worker's URL


@asynccontextmanager
async def open_passthrough(
    engine: RemoteEngine,
    path: str,
    body: dict[str, Any],
    *,
    key: str | None,
    deadline: float = math.inf,
) -> AsyncIterator[Answer]:
    """POST `body` (its `model` replaced by the worker's) to `path` on a worker chosen by
    the fleet's policy for `key`; yield the first answer that is not a retryable failure."""
    attempts = Attempts(engine.fleet, engine.config, key, deadline=deadline)
    failure = WorkerFailure("No worker is available to serve the request.", status=503)
    while (worker := await attempts.next()) is not None:
        worker.in_flight += 1
        answered = False
        try:
            payload = {**body, "model": await engine.model_of(worker)}
            async with engine.client.stream("POST", worker.url + path, json=payload) as response:
                status = response.status_code
                if is_retryable_status(status):
                    message = error_message(await response.aread(), status)
                    failure = WorkerFailure(message, status=status)
                    worker.errors_total += 1
                    worker.breaker.record_failure()
                    continue
                answered = True
                chunks = _Chunks(response, worker)
                yield Answer(
                    status,
                    response.headers.get("content-type", "application/json"),
                    chunks,
                    worker.url,
                )
                if chunks.broken:
                    pass  # counted where it broke; a success now would reset the breaker
                elif counts_against_worker(status):
                    worker.breaker.record_failure()
                else:
                    worker.breaker.record_success()
                return
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            if answered:  # the caller's own error: not the worker's, and never a retry
                raise
            # ValueError, KeyError, IndexError: a /v1/models answer without a model.
            worker.errors_total += 1
            worker.breaker.record_failure()
            detail = str(exc) or type(exc).__name__
            failure = WorkerFailure(f"Worker {worker.url} failed: {detail}", status=503)
        finally:
            worker.in_flight -= 1
    raise failure


class _Chunks:
    """The answer's body; a connection the worker breaks is a 502 `WorkerFailure` (counted
    against it, and `broken` set), so the caller ends its own response cleanly."""

    def __init__(self, response: httpx.Response, worker: Worker) -> None:
        self._bytes = response.aiter_bytes()
        self._worker = worker
        self.broken = False

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._bytes.__anext__()
        except httpx.HTTPError as exc:
            self.broken = True
            self._worker.errors_total += 1
            self._worker.breaker.record_failure()
            detail = str(exc) or type(exc).__name__
            raise WorkerFailure(f"Worker {self._worker.url} failed mid-answer: {detail}") from None
