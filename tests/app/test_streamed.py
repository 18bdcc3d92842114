"""`StreamedBody`: every streamed body yields to the run loop before each chunk, whatever its
subclass does, and raises what failed at delivery instead of its next chunk."""

from __future__ import annotations

from types import TracebackType

import pytest
import trio
import trio.testing

from tributary.app.http.streamed import StreamedBody


class Ready(StreamedBody):
    """Chunks ready at once, as a relay's burst is: `next_chunk` never awaits anything."""

    def __init__(self, count: int) -> None:
        self.left = count

    async def next_chunk(self) -> bytes:
        if not self.left:
            raise StopAsyncIteration
        self.left -= 1
        return b"x"

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


async def test_a_body_whose_chunks_are_ready_still_yields_before_each() -> None:
    body = Ready(3)
    async with body:
        for _ in range(3):
            with trio.testing.assert_checkpoints():
                assert await body.__anext__() == b"x"
        with trio.testing.assert_checkpoints(), pytest.raises(StopAsyncIteration):
            await body.__anext__()


async def test_a_burst_does_not_hold_the_loop() -> None:
    ticks = 0

    async def other_task() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        await trio.lowlevel.checkpoint()  # it has started
        start = ticks
        chunks = [chunk async for chunk in Ready(100)]
        nursery.cancel_scope.cancel()
    assert len(chunks) == 100
    assert ticks - start >= 100


async def test_a_failure_at_delivery_is_raised_instead_of_the_next_chunk() -> None:
    body = Ready(3)
    assert await body.__anext__() == b"x"
    body._failure = RuntimeError("rendering at delivery failed")
    with pytest.raises(RuntimeError, match="rendering at delivery failed"):
        await body.__anext__()
    assert body.left == 2  # next_chunk was not asked


def test_a_body_that_defines_its_own_anext_is_refused() -> None:
    """`__anext__` is where every chunk yields to the run loop: a subclass defines
    `next_chunk`, and one that replaces `__anext__` fails as it is defined."""
    with pytest.raises(TypeError, match=r"overrides StreamedBody\.__anext__"):

        class Overriding(Ready):
            async def __anext__(self) -> bytes:  # type: ignore[misc]
                return b"x"
