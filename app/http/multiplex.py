"""`MultiplexedBody`: several engine streams read as one SSE response body.

Synopsis::

    class MyBody(MultiplexedBody):
        async def next_chunk(self) -> bytes:      # each chunk Quart sends (__anext__)
            backlog = await self.next_backlog()    # [(item index, Output), ...] or None at end
            ...
            if self.exhausted:                     # that backlog held the last terminal item
                ...                                # so the end can go in the same write

Each stream is redirected (`RequestStream.redirect`) into one queue: the engine's scheduler
appends `(index, item)` the moment it produces an item (and wakes the body if it waits), and
`on_item` sees it at that moment, so per-item timing never waits for the client. No task
per stream. `next_backlog` returns everything waiting, so a slow reader gets one coalesced
write instead of many.
Leaving the body early (client gone: `Cancelled`, or `GeneratorExit`), or never entering it,
aborts every unfinished request synchronously (`close`; the view also hands the streams to
the exchange with `owned_by_request`).

A subclass that can render one `Frame` on its own (`render_frame`) lets the body write it
the moment the engine delivers it, when the connection allows (`BodyChunks`,
app/http/direct_send.py): the body's task is parked waiting, nothing else is queued or being
written, and the first chunk (which carries the response head) has gone out. The body's task
then stays asleep; only what the socket does not take at once reaches it, and it goes out
first, through the usual path, before anything rendered later.

Subclasses set whatever `on_item` reads before calling `super().__init__`, since items that
are already waiting are delivered during it. What `on_item` and `render_frame` may do (they
run in the engine's scheduler) is the delivery contract of `StreamedBody` (streamed.py).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from functools import partial
from types import TracebackType

import trio

from tributary.engine import TERMINAL, Frame, Output, RequestStream
from tributary.engine.stream import wait_by

from .direct_send import BodyChunks, body_chunks
from .streamed import StreamedBody

__all__ = ["MultiplexedBody"]

LOGGER = logging.getLogger("tributary.app.multiplex")


class MultiplexedBody(StreamedBody):
    def __init__(self, streams: Sequence[RequestStream]) -> None:
        self._streams = list(streams)
        # What the engine delivered and the body has not taken yet, and the body's task while
        # it waits for more. A deque and a parked task rather than a memory channel: the
        # engine wakes the body directly, and taking what waits needs no `WouldBlock` raised
        # to find the queue empty, nor a channel's statistics object to see it drained.
        self._items: deque[tuple[int, Output]] = deque()
        self._waiter: trio.lowlevel.Task | None = None
        self._left = False
        self._unfinished = len(self._streams)
        #: Writes frames at delivery (None: this connection cannot, or the subclass does
        #: not render frames alone); allowed once a chunk has been sent the usual way.
        self._direct: BodyChunks | None = body_chunks() if self.renders_frames else None
        #: What the socket did not take of a frame written at delivery (framed): the
        #: body's task sends it before anything else.
        self._rest = b""
        # `_failure` (StreamedBody's): rendering a frame at delivery failed, or a stream was
        # closed elsewhere before its end.
        for index, stream in enumerate(self._streams):
            stream.redirect(partial(self._deliver, index), on_close=self._closed_elsewhere)

    #: Whether `render_frame` is implemented (subclasses that render frames one by one).
    renders_frames = False

    def on_item(self, index: int, item: Output) -> None:
        """Called the moment the engine delivers `item` (for timing). Must not block."""

    def render_frame(self, index: int, item: Frame) -> bytes:
        """The bytes of one `Frame` of stream `index`, rendered at delivery (in the engine's
        scheduler) as `next_chunk` would have rendered it alone; folds it into the body's
        state just as `next_chunk` would. Only called when `renders_frames`."""
        raise NotImplementedError

    @property
    def exhausted(self) -> bool:
        """Every stream has delivered its terminal item and every item has been taken."""
        return self._unfinished == 0 and not self._items

    async def next_backlog(self) -> list[tuple[int, Output]] | None:
        """Wait for at least one item; return all that are waiting, or None once every
        stream has ended (or the body was closed). A stream with a deadline
        (`RequestStream.set_deadline`) that has passed ends there with its 408 `Done`, in
        the same backlog as the items that waited. What the socket did not take of a frame
        written at delivery is sent first."""
        while True:
            # Streams only finish meanwhile, which can only put the earliest deadline later.
            # (One closed elsewhere fails the body: `_closed_elsewhere`.)
            deadline = self._deadline() if self._unfinished else math.inf
            # Items that waited while the body was writing are taken as they are: the engine
            # has just run (`StreamedBody.__anext__` checkpoints before each chunk), as it
            # would before a channel's receive, so a busy engine's next items have joined.
            if self.waits_for_chunk():
                await wait_by(deadline, self._wait)
            if self._rest:  # before anything rendered later
                rest, self._rest = self._rest, b""
                assert self._direct is not None
                await self._direct.send_rest(rest)
            if deadline != math.inf and self._unfinished and deadline <= trio.current_time():
                for stream in self._streams:
                    stream.time_out()  # each unfinished one past its deadline hands us its 408
            if self._failure is not None:
                raise self._failure
            if self._left:
                return None
            if self._items:
                backlog = list(self._items)
                self._items.clear()
                return backlog
            if not self._unfinished:
                return None
            # Nothing to take: only the rest of a frame went out. Wait again.

    def _deadline(self) -> float:
        return min((s.deadline for s in self._streams if not s.finished), default=math.inf)

    def waits_for_chunk(self) -> bool:
        # Exactly when `next_backlog` parks in `_wait` (a yield even past a deadline: the
        # cancellation is delivered through the run loop).
        return not self._items and self._unfinished > 0 and not self._left and not self._rest

    async def _wait(self) -> None:
        """Until the engine delivers an item (or the wait is cancelled)."""
        self._waiter = trio.lowlevel.current_task()

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            self._waiter = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def _deliver(self, index: int, item: Output) -> None:
        # Runs in the engine's scheduler: never raise into it.
        try:
            self.on_item(index, item)
        except Exception:
            LOGGER.exception("on_item failed for item %d of a streamed response", index)
        if isinstance(item, TERMINAL):
            self._unfinished -= 1
        if self._left:
            return  # close() has aborted what was unfinished
        direct = self._direct
        if (
            direct is not None
            and self._waiter is not None  # parked: no write of ours is under way
            and self._calls > 1  # a chunk (with the head) has gone out
            and type(item) is Frame
            and not self._items
            and not self._rest
            and self._ready(direct)
        ):
            try:
                self._rest = direct.write(self.render_frame(index, item))
            except Exception as exc:
                # Raised by the body's task, as a failure to render there would be; the frame
                # may be folded in already, so the body ends rather than carry on without it.
                self._failure = exc
                self.close()
                return
            if self._rest:
                self._wake()  # it sends the rest
            return
        self._items.append((index, item))
        self._wake()

    def _closed_elsewhere(self) -> None:
        # A stream closed before its end by someone other than this body (whose close()
        # sets _left first): nothing more comes from it, so the response cannot be whole.
        # It ends as a failure does, raised by the body's task: no [DONE], not counted.
        if self._left or self._failure is not None:
            return
        self._failure = RuntimeError("a stream of this response was closed before its end")
        self._wake()

    def _ready(self, direct: BodyChunks) -> bool:
        try:
            return direct.ready()
        except Exception:  # internals not as expected: the usual path, from now on
            LOGGER.exception("writing frames at delivery is off for this response")
            self._direct = None
            return False

    def close(self) -> None:
        """Abort every unfinished request and stop receiving (a waiting `next_backlog`
        returns None, and nothing more is written). Synchronous and idempotent."""
        self._left = True
        for stream in self._streams:
            stream.close()
        self._items.clear()
        self._wake()

    def _wake(self) -> None:
        """Reschedule the body's task if it waits in `_wait`."""
        if self._waiter is not None:
            task, self._waiter = self._waiter, None
            trio.lowlevel.reschedule(task)

    # Quart types this as returning None; a context manager may return a bool.
    async def __aexit__(  # type: ignore[override]
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self.close()
        return None
