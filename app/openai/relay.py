"""`relay_to_worker`: a front's `/v1/chat/completions`, answered by one of its workers.

The prompt of a chat request is the messages rendered with the model's chat template and
tokenized by its tokenizer; a front has neither (they stay on the workers, as tokenization
does), so it hands the request to a worker whole (`PassthroughService.open_passthrough`) and
relays the answer: the worker's status, content type and body, unary or streamed, byte for
byte. The front checks what it can before choosing a worker (the body is a JSON object, the
model is the one it serves) and keeps its own guarantees: a worker that fails before
answering is retried elsewhere; a client that leaves closes the upstream response (the
worker aborts the request); `--request-timeout` / `X-Request-Timeout` end the request with
a 408 (a stream with an error event and `[DONE]`); a worker that breaks the connection
mid-stream ends the stream with a 502 error event and `[DONE]` (504 if it went silent for
`--worker-timeout`). A unary answer is held whole before it is relayed, within the front's
`--max-worker-answer-bytes` (past it, a 502); an error answer's body is cut at 1 MiB and
its status relayed (a cut body as the message it begins with). A body with a custom logit
processor is refused (501) unless the front was started with
`--enable-custom-logit-processor`.

Timing: as a local chat's, from after the body is checked (`RequestTiming`, handed to the
exchange like any request's, so /metrics and the access log see it): its end is when a unary
answer has been read whole, or when a relayed stream, its last chunk relayed to the client,
is seen to end; its first token is the first chunk of a relayed stream (the front sees no
tokens: a relayed chat counts 0 of them, and no phases), and it is an answer unless it failed
(an error status, a broken stream, the deadline, an error event in the stream).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any

import trio
from quart import Response

from tributary.engine import EngineError, PassthroughService, WorkerFailure

from ..http.errors import InvalidRequest
from ..http.limits import Deadline, RequestTimedOut
from ..http.responses import json_response
from ..http.sse import DONE, sse_event, sse_response
from ..http.streamed import StreamedBody
from ..observe.timing import RequestSink, RequestTiming
from .errors import openai_error_object
from .served import ServedModel

__all__ = ["relay_to_worker", "routing_key"]


#: How long closing the worker's response may take. httpx drops an unfinished connection
#: without a round trip, but the close is shielded, so a bound keeps a transport that
#: waits from holding a cancelled request open.
CLOSE_SECONDS = 5.0

#: How an error event of an OpenAI stream begins (`{"error": {...}}`, as Tributary, SGLang and
#: vLLM send one); a content chunk's JSON begins with another key, and a string value that
#: holds these bytes has its quotes escaped.
ERROR_EVENT = b'data: {"error"'

#: How much of a relayed stream's last bytes is kept to find an error event split across
#: two network chunks: all of it but its last byte.
_TAIL = len(ERROR_EVENT) - 1


async def relay_to_worker(
    served: ServedModel,
    passthrough: PassthroughService,
    path: str,
    body: Any,
    owned: list[Any],
    exchange: RequestSink | None = None,
    *,
    deadline: Deadline,
) -> Response:
    """Raises `EngineError` (OpenAI-shaped by the blueprint) before the first byte. A
    streamed answer's upstream response goes into `owned` (`owned_by_request`), so it is
    closed even if the client leaves before Quart starts on the body. `exchange` is where
    its timing goes (`RequestSink`)."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    served.check_model(body.get("model"))
    stack = AsyncExitStack()
    answer_context = passthrough.open_passthrough(
        path, body, key=routing_key(body), deadline=deadline.at
    )
    timing = RequestTiming.start(exchange).for_item()
    try:
        with trio.fail_at(deadline.at):
            answer = await stack.enter_async_context(answer_context)
            # The worker's answer, not the request's `stream`, says whether it streams: a
            # `"stream": 1` that SGLang or vLLM reads as true, or a JSON answer to a stream.
            if answer.status >= 400:
                # An error: its status decides, and its body is cut at the front's
                # `max_error_bytes` (a cut body is relayed as the message it begins with).
                data, cut = await answer.read_error()
                timing.relayed_end(answered=False)
                await _close(stack)
                if cut is not None:
                    error = WorkerFailure(cut, status=answer.status)
                    return json_response(openai_error_object(error), status=answer.status)
                return Response(data, status=answer.status, content_type=answer.content_type)
            if answer.status != 200 or not answer.content_type.startswith("text/event-stream"):
                # Held whole, so bounded: past the front's limit a 502, the rest unread.
                data = await answer.read_whole()
                timing.relayed_end(answered=answer.status == 200)
                await _close(stack)
                return Response(data, status=answer.status, content_type=answer.content_type)
    except trio.TooSlowError:
        timing.relayed_end(answered=False)
        await _close(stack)
        raise RequestTimedOut(deadline.message) from None
    except BaseException as exc:
        if isinstance(exc, EngineError):  # not a client that left: that one never ended
            timing.relayed_end(answered=False)
        await _close(stack)
        raise
    relayed = _Relayed(answer.chunks, stack, deadline, timing)
    owned.append(relayed)
    return sse_response(relayed)


class _Relayed(StreamedBody):
    """The worker's stream as it arrives. Closing it (Quart does, when the response ends or
    its client leaves) closes the worker's response. A deadline or a worker that breaks the
    stream ends it with an OpenAI error event and [DONE]. A body, not an async generator:
    each wait sits in its own cancel scope, never one held across a yield."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        stack: AsyncExitStack,
        deadline: Deadline,
        timing: RequestTiming,
    ):
        self._chunks = chunks
        self._stack = stack
        self._deadline = deadline
        self._timing = timing
        self._failed = False  # an error event went by
        self._tail = b""  # the last `_TAIL` bytes relayed, until an error event is found
        self._ended = False

    async def next_chunk(self) -> bytes:
        # httpx hands over what one receive brought without yielding, and the write of each
        # chunk may not yield either (app/http/direct_send.py): a burst must not hold the
        # loop, which `StreamedBody.__anext__` sees to, checkpointing before each chunk.
        if self._ended:
            raise StopAsyncIteration
        try:
            with trio.fail_at(self._deadline.at):
                chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            self._ended = True
            self._timing.relayed_end(answered=not self._failed)
            raise
        except trio.TooSlowError:
            return self._last(RequestTimedOut(self._deadline.message))
        except EngineError as exc:  # the worker broke the connection mid-stream
            return self._last(exc)
        self._timing.relayed_output()
        if not self._failed:
            self._scan(chunk)
        return chunk

    def _scan(self, chunk: bytes) -> None:
        # An error event may arrive split across chunks: one that begins in the bytes kept
        # from before ends within this chunk's first `_TAIL` bytes.
        tail = self._tail
        if ERROR_EVENT in chunk or (tail and ERROR_EVENT in tail + chunk[:_TAIL]):
            self._failed = True
        elif len(chunk) >= _TAIL:
            self._tail = chunk[-_TAIL:]
        else:
            self._tail = (tail + chunk)[-_TAIL:]

    def _last(self, error: EngineError) -> bytes:
        self._ended = True
        self._timing.relayed_end(answered=False)
        return sse_event(openai_error_object(error)) + DONE

    async def aclose(self) -> None:
        """Idempotent: Quart calls it as the body ends, the exchange again as it ends."""
        self._ended = True
        await _close(self._stack)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


async def _close(stack: AsyncExitStack) -> None:
    # Shielded: it runs as the client leaves (its handler cancelled), and the worker learns
    # that its client left only when the upstream response is closed. Bounded: cut short,
    # the connection is dropped rather than closed cleanly, and in_flight still goes down.
    with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_SECONDS):
        await stack.aclose()


def routing_key(body: dict[str, Any]) -> str | None:
    """What `cache_aware` routes a chat request by: its messages' text, in order (requests
    sharing a conversation's beginning share a prefix). A content given as parts counts by
    its text parts, as the string it stands for."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    parts = []
    for message in messages:
        if isinstance(message, dict):
            parts.append(f"{message.get('role')}:{_text_of(message.get('content'))}")
    return "\n".join(parts) or None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "image_url", ...}]
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""
