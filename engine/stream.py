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

A consumer that only wants the end of each stream (a unary answer) uses `collect_redirected`:
its callback sees every item at delivery and the consumer wakes once, at the end, instead of
once per token.

A deadline (`set_deadline`) bounds every wait for the next item with a Trio cancel scope: at
the deadline the request is aborted and the stream ends with a `Done` carrying a 408 abort
finish_reason, at once, without waiting for the scheduler's next step boundary. A consumer of
redirected streams bounds its own wait by `stream.deadline` (`wait_by`) and then calls
`time_out()`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from types import TracebackType
from typing import TypeVar

import trio

from .errors import RequestTruncated
from .request import TERMINAL, Done, Error, FinishReason, Frame, Output, abort_reason

__all__ = [
    "OutputSender",
    "RequestStream",
    "collect_redirected",
    "open_output_channel",
    "wait_by",
]

LOGGER = logging.getLogger("tributary.engine.stream")

T = TypeVar("T")


async def wait_by(deadline: float, wait: Callable[[], Awaitable[T]]) -> T | None:
    """`await wait()`, given up at Trio time `deadline` (`math.inf`: never).

    Returns what `wait()` returned, or None if the deadline came first: `wait()` is then
    cancelled there (`trio.move_on_at`), or at its first checkpoint for a deadline already
    past (a Trio receive then takes nothing). A cancellation from outside propagates.
    So None means a timeout only where `wait()` never returns None: a caller that reads
    the result passes such a `wait` (`RequestStream` a channel's receive, whose items are
    outputs); the others wait for an event and read the time, not the result.
    """
    if deadline == math.inf:
        return await wait()
    with trio.move_on_at(deadline):
        return await wait()
    return None


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
        if isinstance(item, TERMINAL):
            self._terminal = True
        if self._sink is not None:
            self._call_sink(item)
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
            self._call_sink(Error(self._rid, RequestTruncated()))
        # The sink leads back to its stream, which holds this sender: dropping it lets a
        # finished request be freed by reference counting instead of the cycle collector.
        self._sink = None

    def _call_sink(self, item: Output) -> None:
        # The sink runs in the producer (the engine's scheduler): a bug in one consumer must
        # not end the scheduler, and every other request with it.
        assert self._sink is not None
        try:
            self._sink(item)
        except Exception:
            LOGGER.exception("the sink of request %s raised; the item is lost", self._rid)

    def _redirect(self, sink: Callable[[Output], None]) -> None:
        self._sink = sink
        if self._closed:  # over (or truncated) before the redirect
            self.close()


def open_output_channel(rid: str) -> tuple[OutputSender, trio.MemoryReceiveChannel[Output]]:
    """One request's output channel: the producer's `OutputSender` and the receiving end to
    build its `RequestStream` on (`RequestStream(..., receiver=r, sender=s)`)."""
    # (Not `open_memory_channel[Output](...)`: subscripting costs every request 0.6 µs.)
    send: trio.MemorySendChannel[Output]
    receive: trio.MemoryReceiveChannel[Output]
    send, receive = trio.open_memory_channel(math.inf)
    return OutputSender(rid, send), receive


class RequestStream:
    def __init__(
        self,
        *,
        rid: str,
        prompt_tokens: int,
        receiver: trio.MemoryReceiveChannel[Output],
        abort: Callable[[], None],
        abort_with: Callable[[FinishReason], None] | None = None,
        sender: OutputSender | None = None,
    ) -> None:
        self._abort = abort  # aborts this request's sequence, not whatever holds its rid later
        # ... with a given finish_reason (a deadline's); a plain abort where not supported.
        self._abort_with = abort_with or (lambda _reason: abort())
        self._sender = sender  # the producing end, for redirect
        #: The consumer's sink, from redirect until the terminal item (then let go of, as
        #: it usually refers back to this stream).
        self._sink: Callable[[Output], None] | None = None
        #: Called if the stream is closed before its terminal item (see redirect).
        self._on_close: Callable[[], None] | None = None
        self._redirected = False
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

    @property
    def closed(self) -> bool:
        """`close()` was called: nothing more comes from this stream, not even a 408."""
        return self._closed

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
            item = await self._receive()
        except trio.EndOfChannel:
            # Only an engine bug closes a channel without a terminal item; say so rather than
            # pretend the request ended normally.
            item = Error(self.rid, RequestTruncated())
        if isinstance(item, TERMINAL):
            self._terminal = True
        else:
            self._last = item
        return item

    async def _receive(self) -> Output:
        if self._timeout_reason is None:
            return await self._receiver.receive()
        item = await wait_by(self._deadline, self._receiver.receive)
        return self._timeout_done() if item is None else item

    @property
    def deadline(self) -> float:
        """The Trio time this stream ends by (`set_deadline`); inf without one."""
        return self._deadline

    def time_out(self) -> None:
        """For a redirected stream's consumer, once `deadline` has passed: unless the request
        has ended, abort it and hand the sink the 408 `Done` that ends it (as iterating would
        return it). Nothing the engine delivers afterwards reaches the sink."""
        if self._sink is None or self._terminal or self._closed or self._timeout_reason is None:
            return
        if trio.current_time() >= self._deadline:
            self._end_with(self._timeout_done())

    def _timeout_done(self) -> Done:
        assert self._timeout_reason is not None
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

    def redirect(
        self, sink: Callable[[Output], None], *, on_close: Callable[[], None] | None = None
    ) -> None:
        """From now on the producer hands each item to `sink` as it produces it; items
        already queued go first, at once and in order. The stream is no longer iterated
        (iterating it ends at once), but `close()` still aborts the request unless `sink`
        has been given its terminal item, and after `close()` or the terminal item nothing
        reaches `sink`. A `close()` before the terminal item calls `on_close()` instead (a
        consumer waiting for the terminal item learns that none will come).

        `sink` runs in the producer (the engine's scheduler), so it must not block or raise;
        it is the moment of delivery, which is what per-request timing wants to observe.
        A deadline is the consumer's to enforce: wait at most until `deadline`, then call
        `time_out()`. An item the producer delivers after the deadline, before the consumer
        has called `time_out()` (it was busy writing to a slow client), is dropped and the
        sink gets the 408 `Done` in its place.
        """
        if self._sender is None:
            raise TypeError("this stream was built without its sender; it cannot be redirected")
        self._redirected = True
        if self._terminal or self._closed:
            return
        self._sink = sink
        self._on_close = on_close
        while True:
            try:
                self._deliver(self._receiver.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        if not self._terminal:
            self._sender._redirect(self._deliver)

    def _deliver(self, item: Output) -> None:
        """Hand the producer's `item` to the sink (a redirected stream)."""
        if self._sink is None or self._closed or self._terminal:
            return  # the consumer left, or the stream ended (a deadline's Done)
        if self._timeout_reason is not None and trio.current_time() >= self._deadline:
            # Produced after the deadline, before the consumer woke to call time_out()
            # (a slow reader): it is dropped, and the stream ends with the 408 here.
            self._end_with(self._timeout_done())
        elif isinstance(item, TERMINAL):
            self._end_with(item)
        else:
            self._last = item
            self._sink(item)

    def _end_with(self, item: Output) -> None:
        """Hand the sink its terminal `item`; nothing reaches it afterwards. (Building a
        deadline's `Done` aborts the request, which may end the stream first: then nothing.)"""
        sink, self._sink = self._sink, None
        self._on_close = None
        if sink is None or self._terminal:
            return
        self._terminal = True
        sink(item)

    def close(self) -> None:
        """Abort the request unless it has finished, and stop receiving. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._sink = None
        on_close, self._on_close = self._on_close, None
        if not self._terminal:
            self._abort()
            if on_close is not None:
                on_close()
        self._receiver.close()


async def collect_redirected(
    streams: Sequence[RequestStream], on_item: Callable[[int, Output], bool]
) -> None:
    """Redirect every stream to `on_item(index, item)`, called in the producer the moment
    each item is produced, and return once every stream has delivered its terminal item,
    or at once when `on_item` returns True (a failure that ends the whole response). The
    caller wakes once, at the end, not once per item.

    Each stream's deadline bounds the wait as iterating it would: at the earliest one, the
    streams past their deadline deliver their 408 `Done`. The caller still owns the streams
    and closes them (which aborts any unfinished request); one closed by another task
    meanwhile delivers nothing more and is waited for no longer.

    If `on_item` raises, nothing more reaches it and the exception is raised here, in the
    caller, as iterating and handling the items in the caller would have raised it; it
    never reaches the producer.
    """
    # (One that has ended, or was closed, before this call delivers nothing more.)
    unfinished = sum(1 for s in streams if not s.finished and not s.closed)
    done = trio.Event()
    failure: list[BaseException] = []

    def closed_meanwhile() -> None:
        nonlocal unfinished
        unfinished -= 1
        if unfinished == 0:
            done.set()

    def sink(index: int, item: Output) -> None:
        nonlocal unfinished
        if failure:
            return
        if isinstance(item, TERMINAL):
            unfinished -= 1
        try:
            stop = on_item(index, item)
        except Exception as exc:
            failure.append(exc)
            stop = True
        if stop or unfinished == 0:
            done.set()

    for index, stream in enumerate(streams):
        stream.redirect(partial(sink, index), on_close=closed_meanwhile)
    while not done.is_set():
        # A stream closed elsewhere delivers nothing more, not even a 408: once only such
        # streams are unfinished, there is nothing left to wait for.
        live = [s for s in streams if not s.finished and not s.closed]
        if not live:
            break
        await wait_by(min(s.deadline for s in live), done.wait)
        for stream in streams:
            stream.time_out()  # those past their deadline hand `sink` their 408 Done
    if failure:
        raise failure[0]
