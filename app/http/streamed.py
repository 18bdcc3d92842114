"""`StreamedBody`: the base of every streamed response body, and the delivery contract.

Synopsis::

    class MyBody(StreamedBody):
        async def next_chunk(self) -> bytes:       # the next chunk Quart sends, or
            ...                                    # raise StopAsyncIteration at the end

        async def __aexit__(self, *exc_info) -> None:
            ...                                    # release what the body holds

The delivery contract. Engine output reaches the HTTP side in two places, in two tasks:

- **At delivery**, in the producer: a sink (`RequestStream.redirect`, `collect_redirected`)
  runs in the engine's scheduler, synchronously, the moment an item is produced, inside the
  scheduler's commit of a step. The sinks are `MultiplexedBody`'s (`on_item`,
  `render_frame`) and the unary answers' (`sglang/generate.py` `_Answer.take`,
  `openai/choices.py` `collect`). A sink may observe timing and metrics, fold the item into
  its state, render bytes and write them through `BodyChunks` (which never yields), and
  wake the body's task. It must not await, block or take a lock, and its work must be
  bounded by the item's size: every other request waits for it. It must not raise either:
  what fails at delivery is recorded (`_failure`) and raised by the body's task at its next
  chunk (an exception that escapes anyway is logged by the stream, and the item is lost).
- **In the body**, in the response's task: Quart iterates the body; `next_chunk` renders
  what delivery left, waits for more, and ends. `__anext__` is this class's, never a
  subclass's: it checkpoints before every chunk, so a body yields to the run loop between
  chunks even when they are ready at once (a relay's burst) and its writes do not yield (a
  direct write is not a checkpoint: `direct_send.py`).

Ownership: a view hands the body to its exchange (`owned_by_request`) before returning it,
so its requests are aborted even when Quart never enters the body. Closing (`__aexit__`, and
the body's own `close()` or `aclose()`, which `CloseOwned` calls as the exchange ends) is
idempotent; a synchronous `close()` aborts every unfinished request at once, an `aclose()`
is bounded in time. A subclass that defines `__anext__` is refused as it is defined.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import final

import trio
from quart.wrappers.response import ResponseBody

__all__ = ["StreamedBody"]


class StreamedBody(ResponseBody):
    #: Calls of `__anext__` so far: each call after the first follows a chunk that was sent.
    _calls = 0
    #: What failed outside the body's task (at delivery), raised by the body's task instead
    #: of its next chunk.
    _failure: Exception | None = None
    #: Set by the subclass once `next_chunk` has returned its last chunk (or the body was
    #: closed): what follows is the end, not a chunk, so `__anext__` does not yield first.
    _ended = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "__anext__" in cls.__dict__:  # `@final` says so to a type checker; this, at import
            raise TypeError(f"{cls.__name__} overrides StreamedBody.__anext__: define next_chunk")

    async def __aenter__(self) -> StreamedBody:
        return self

    def __aiter__(self) -> StreamedBody:
        return self

    @final
    async def __anext__(self) -> bytes:
        self._calls += 1
        if not (self._ended or self.waits_for_chunk()):
            # Before anything else: let the engine and the other requests run (and, for a
            # body fed at delivery, let a busy engine's next items join this chunk).
            await trio.lowlevel.checkpoint()
        if self._failure is None:
            chunk = await self.next_chunk()
            if self._failure is None:
                return chunk
        raise self._failure

    def waits_for_chunk(self) -> bool:
        """True only when `next_chunk` will park (a yield) before it makes its chunk, so
        `__anext__` need not checkpoint first. By default False: always checkpoint."""
        return False

    @abstractmethod
    async def next_chunk(self) -> bytes:
        """The next chunk to send; raise StopAsyncIteration at the end."""
