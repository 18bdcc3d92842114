"""`RequestStream`: one request's outputs, as an async iterator fed by a memory channel.

Synopsis::

    async with engine.submit(request) as stream:
        async for item in stream:          # Frame ... then Done or Error, then the loop ends
            ...

Leaving the `async with` block before the terminal item aborts the request. The abort is
synchronous (it only marks the sequence), so it is safe in `finally`, under cancellation and
when a generator is closed with `GeneratorExit`.

A consumer that merges several streams (an SSE body over a batch) can take the items
without a task per stream: `stream.redirect(sink)` makes the producer call `sink(item)` the
moment it produces each item, instead of queueing it for iteration. The producing end is an
`OutputSender` (`open_output_channel`), whatever produces the items.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import TracebackType

import trio

from .errors import RequestTruncated
from .request import Done, Error, Output

__all__ = ["OutputSender", "RequestStream", "open_output_channel"]


class OutputSender:
    """The producing end of one request's outputs: `send` queues an item for the stream's
    iterator, or hands it straight to the sink the consumer redirected the stream to.
    Never blocks and never raises: a consumer that left is simply not reached."""

    def __init__(self, rid: str, channel: trio.MemorySendChannel[Output]) -> None:
        self._rid = rid
        self._channel = channel
        self._sink: Callable[[Output], None] | None = None
        self._terminal = False
        self._closed = False

    def send(self, item: Output) -> None:
        if isinstance(item, Done | Error):
            self._terminal = True
        if self._sink is not None:
            self._sink(item)
            return
        try:
            self._channel.send_nowait(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the consumer left; its RequestStream has already aborted the request

    def close(self) -> None:
        """No more items. Closing before a terminal item truncates the stream, which its
        consumer sees as a `RequestTruncated` error."""
        self._closed = True
        self._channel.close()
        if self._sink is not None and not self._terminal:
            self._terminal = True
            self._sink(Error(self._rid, RequestTruncated()))

    def _redirect(self, sink: Callable[[Output], None]) -> None:
        self._sink = sink
        if self._closed and not self._terminal:  # truncated before the redirect
            self.close()


def open_output_channel(rid: str) -> tuple[OutputSender, trio.MemoryReceiveChannel[Output]]:
    """One request's output channel: the producer's `OutputSender` and the receiving end to
    build its `RequestStream` on (`RequestStream(..., receiver=r, sender=s)`)."""
    send, receive = trio.open_memory_channel[Output](math.inf)
    return OutputSender(rid, send), receive


class RequestStream:
    def __init__(
        self,
        *,
        rid: str,
        prompt_tokens: int,
        receiver: trio.MemoryReceiveChannel[Output],
        abort: Callable[[], None],
        sender: OutputSender | None = None,
    ) -> None:
        self._abort = abort  # aborts this request's sequence, not whatever holds its rid later
        self._sender = sender  # the producing end, for redirect
        self._redirected = False
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
        if self._terminal or self._closed or self._redirected:
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

    def redirect(self, sink: Callable[[Output], None]) -> None:
        """From now on the producer hands each item to `sink` as it produces it; items
        already queued go first, at once and in order. The stream is no longer iterated
        (iterating it ends at once), but `close()` still aborts the request unless `sink`
        has been given its terminal item, and after `close()` nothing reaches `sink`.

        `sink` runs in the producer (the engine's scheduler), so it must not block or raise;
        it is the moment of delivery, which is what per-request timing wants to observe.
        """
        if self._sender is None:
            raise TypeError("this stream was built without its sender; it cannot be redirected")
        self._redirected = True

        def deliver(item: Output) -> None:
            if self._closed:
                return  # the consumer left: like a closed receiver, nothing reaches it
            if isinstance(item, Done | Error):
                self._terminal = True
            sink(item)

        while True:
            try:
                deliver(self._receiver.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        if not self._terminal:
            self._sender._redirect(deliver)

    def close(self) -> None:
        """Abort the request unless it has finished, and stop receiving. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._terminal:
            self._abort()
        self._receiver.close()
