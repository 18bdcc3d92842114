"""`relay_to_worker`: a front's `/v1/chat/completions`, answered by one of its workers.

The prompt of a chat request is the messages rendered with the model's chat template and
tokenized by its tokenizer; a front has neither (they stay on the workers, as tokenization
does), so it hands the request to a worker whole (`EngineService.open_passthrough`) and
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
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import trio
from quart import Response

from tributary.engine import EngineError, WorkerFailure

from ..limits import Deadline, RequestTimedOut
from ..multiplex import sse_response
from ..output import json_response
from ..sse import DONE, sse_event
from .errors import InvalidRequest, openai_error_object
from .served import ServedModel

__all__ = ["relay_to_worker", "routing_key"]


#: How long closing the worker's response may take. httpx drops an unfinished connection
#: without a round trip, but the close is shielded, so a bound keeps a transport that
#: waits from holding a cancelled request open.
CLOSE_SECONDS = 5.0


async def relay_to_worker(
    served: ServedModel, path: str, body: Any, owned: list[Any], *, deadline: Deadline
) -> Response:
    """Raises `EngineError` (OpenAI-shaped by the blueprint) before the first byte. A
    streamed answer's upstream response goes into `owned` (`owned_by_request`), so it is
    closed even if the client leaves before Quart starts on the body."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    served.check_model(body.get("model"))
    stack = AsyncExitStack()
    passthrough = served.engine.open_passthrough(
        path, body, key=routing_key(body), deadline=deadline.at
    )
    try:
        with trio.fail_at(deadline.at):
            answer = await stack.enter_async_context(passthrough)
            # The worker's answer, not the request's `stream`, says whether it streams: a
            # `"stream": 1` that SGLang or vLLM reads as true, or a JSON answer to a stream.
            if answer.status >= 400:
                # An error: its status decides, and its body is cut at the front's
                # `max_error_bytes` (a cut body is relayed as the message it begins with).
                data, cut = await answer.read_error()
                await _close(stack)
                if cut is not None:
                    error = WorkerFailure(cut, status=answer.status)
                    return json_response(openai_error_object(error), status=answer.status)
                return Response(data, status=answer.status, content_type=answer.content_type)
            if answer.status != 200 or not answer.content_type.startswith("text/event-stream"):
                # Held whole, so bounded: past the front's limit a 502, the rest unread.
                data = await answer.read_whole()
                await _close(stack)
                return Response(data, status=answer.status, content_type=answer.content_type)
    except trio.TooSlowError:
        await _close(stack)
        raise RequestTimedOut(deadline.message) from None
    except BaseException:
        await _close(stack)
        raise
    relayed = _Relayed(answer.chunks, stack, deadline)
    owned.append(relayed)
    return sse_response(relayed)


class _Relayed:
    """The worker's stream as it arrives. Closing it (Quart does, when the response ends or
    its client leaves) closes the worker's response. A deadline or a worker that breaks the
    stream ends it with an OpenAI error event and [DONE]. An iterator, not an async
    generator: each wait sits in its own cancel scope, never one held across a yield."""

    def __init__(self, chunks: AsyncIterator[bytes], stack: AsyncExitStack, deadline: Deadline):
        self._chunks = chunks
        self._stack = stack
        self._deadline = deadline
        self._ended = False

    def __aiter__(self) -> _Relayed:
        return self

    async def __anext__(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        # httpx hands over what one receive brought without yielding, and the write of each
        # chunk may not yield either (app/direct_send.py): a burst must not hold the loop.
        await trio.lowlevel.checkpoint()
        try:
            with trio.fail_at(self._deadline.at):
                return await self._chunks.__anext__()
        except StopAsyncIteration:
            self._ended = True
            raise
        except trio.TooSlowError:
            return self._last(RequestTimedOut(self._deadline.message))
        except EngineError as exc:  # the worker broke the connection mid-stream
            return self._last(exc)

    def _last(self, error: EngineError) -> bytes:
        self._ended = True
        return sse_event(openai_error_object(error)) + DONE

    async def aclose(self) -> None:
        """Idempotent: Quart calls it as the body ends, the exchange again as it ends."""
        self._ended = True
        await _close(self._stack)


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
