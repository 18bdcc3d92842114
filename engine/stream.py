"""`RequestStream`: one request's outputs, as an async iterator fed by a memory channel.

Synopsis::

    async with engine.submit(request) as stream:
        async for item in stream:          # Frame ... then Done or Error, then the loop ends
            ...

Leaving the `async with` block before the terminal item aborts the request. The abort is
synchronous (it only marks the sequence), so it is safe in `finally`, under cancellation and
when a generator is closed with `GeneratorExit`.

A deadline (`set_deadline`) bounds every wait for the next item with a Trio cancel scope: at
the deadline the request is aborted and the stream ends with a `Done` carrying a 408 abort
finish_reason, at once, without waiting for the scheduler's next step boundary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import TracebackType

import trio

from .errors import RequestTruncated
from .request import Done, Error, FinishReason, Frame, Output, abort_reason

__all__ = ["RequestStream"]


class RequestStream:
    def __init__(
        self,
        *,
        rid: str,
        prompt_tokens: int,
        receiver: trio.MemoryReceiveChannel[Output],
        abort: Callable[[], None],
        abort_with: Callable[[FinishReason], None] | None = None,
    ) -> None:
        self._abort = abort  # aborts this request's sequence, not whatever holds its rid later
        # ... with a given finish_reason (a deadline's); a plain abort where not supported.
        self._abort_with = abort_with or (lambda _reason: abort())
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self._receiver = receiver
        self._terminal = False  # a Done or Error has been handed out
        self._closed = False
        self._deadline = math.inf
        self._timeout_reason: FinishReason | None = None
        self._last: Frame | None = None  # for the counts of a deadline's Done

    def set_deadline(self, at: float, *, message: str = "Request timed out.") -> None:
        """End the request at Trio time `at` unless it has ended by then.

        From then on, a read that would wait past `at` (or starts after it) aborts the
        request (its sequence is freed at the next step boundary, at once if it is still
        queued) and returns a `Done` with no new output, the counts so far, and finish_reason
        `{"type": "abort", "message": message, "status_code": 408, "err_type": "timeout"}`;
        the stream ends there. Items the engine delivers after the deadline are dropped."""
        self._deadline = at
        self._timeout_reason = abort_reason(message, status_code=408, err_type="timeout")

    @property
    def finished(self) -> bool:
        return self._terminal

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Output:
        if self._terminal or self._closed:
            raise StopAsyncIteration
        try:
            item = await self._receive()
        except trio.EndOfChannel:
            # Only an engine bug closes a channel without a terminal item; say so rather than
            # pretend the request ended normally.
            item = Error(self.rid, RequestTruncated())
        if isinstance(item, Done | Error):
            self._terminal = True
        else:
            self._last = item
        return item

    async def _receive(self) -> Output:
        if self._timeout_reason is None:
            return await self._receiver.receive()
        with trio.move_on_at(self._deadline):
            return await self._receiver.receive()
        reason = self._timeout_reason
        self._abort_with(reason)
        last = self._last
        return Done(
            self.rid,
            "",
            [],
            self.prompt_tokens if last is None else last.prompt_tokens,
            0 if last is None else last.completion_tokens,
            0 if last is None else last.cached_tokens,
            finish_reason=reason,
        )

    def close(self) -> None:
        """Abort the request unless it has finished, and stop receiving. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._terminal:
            self._abort()
        self._receiver.close()
