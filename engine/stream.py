"""`RequestStream`: one request's outputs, as an async iterator fed by a memory channel.

Synopsis::

    async with engine.submit(request) as stream:
        async for item in stream:          # Frame ... then Done or Error, then the loop ends
            ...

Leaving the `async with` block before the terminal item aborts the request. The abort is
synchronous (it only marks the sequence), so it is safe in `finally`, under cancellation and
when a generator is closed with `GeneratorExit`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import trio

from .errors import RequestTruncated
from .request import Done, Error, Output

__all__ = ["RequestStream"]


class RequestStream:
    def __init__(
        self,
        *,
        rid: str,
        prompt_tokens: int,
        receiver: trio.MemoryReceiveChannel[Output],
        abort: Callable[[], None],
    ) -> None:
        self._abort = abort  # aborts this request's sequence, not whatever holds its rid later
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self._receiver = receiver
        self._terminal = False  # a Done or Error has been handed out
        self._closed = False

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
            item = await self._receiver.receive()
        except trio.EndOfChannel:
            # Only an engine bug closes a channel without a terminal item; say so rather than
            # pretend the request ended normally.
            item = Error(self.rid, RequestTruncated())
        if isinstance(item, Done | Error):
            self._terminal = True
        return item

    def close(self) -> None:
        """Abort the request unless it has finished, and stop receiving. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._terminal:
            self._abort()
        self._receiver.close()
