"""`MultiplexedBody` under cancellation at every point Quart can deliver it.

Found by the disconnect soak (test_soak.py): a client that closed just as its stream's body
was entered made `__aenter__` raise `Cancelled` after it had opened the pumps' nursery. A
context manager whose `__aenter__` raises never gets `__aexit__`, so the nursery stayed open
and Trio reported "Nursery stack corrupted" (Hypercorn logged it as an ASGI error).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tributary.app.http.multiplex import MultiplexedBody
from tributary.engine import Engine, Frame, GenerateRequest, SamplingParams
from tributary.engine.stream import RequestStream, open_output_channel
from tributary.testing import wait_engine_idle


class Body(MultiplexedBody):
    async def next_chunk(self) -> bytes:
        if await self.next_backlog() is None:
            raise StopAsyncIteration
        return b"chunk"


def long_request(engine: Engine) -> Body:
    sampling = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1000})
    return Body([engine.submit(GenerateRequest(text="hi", sampling=sampling))])


async def test_a_body_entered_under_cancellation_cleans_up(tributary_engine: Engine) -> None:
    body = long_request(tributary_engine)
    with trio.CancelScope() as scope:
        scope.cancel()  # the client is already gone when Quart enters the body
        async with body:
            await trio.lowlevel.checkpoint()
            pytest.fail("the body ran on under a cancelled scope")
    assert scope.cancelled_caught
    await wait_engine_idle(tributary_engine)  # the request was aborted


async def test_a_body_cancelled_while_reading_cleans_up(tributary_engine: Engine) -> None:
    body = long_request(tributary_engine)
    with trio.move_on_after(0.05) as scope:
        async with body:
            async for _ in body:
                pass
    assert scope.cancelled_caught
    await wait_engine_idle(tributary_engine)


async def test_items_that_waited_past_the_deadline_go_out_with_every_408(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Two streams with one deadline; a frame arrives before it, while the body is busy
    # writing to a slow client until after it: the frame and both 408s make one write.
    channels = [open_output_channel(f"r{i}") for i in range(2)]
    streams = [
        RequestStream(rid=f"r{i}", prompt_tokens=1, receiver=r, abort=lambda: None, sender=s)
        for i, (s, r) in enumerate(channels)
    ]
    for stream in streams:
        stream.set_deadline(trio.current_time() + 1.0)
    body = Body(streams)
    channels[0][0].send(Frame("r0", "x", [1], 1, 1, 0))
    await trio.sleep(2)  # the slow write
    backlog = await body.next_backlog()
    assert backlog is not None
    assert [(i, type(item).__name__) for i, item in backlog] == [
        (0, "Frame"),
        (0, "Done"),
        (1, "Done"),
    ]
    assert all(item.finish_reason["status_code"] == 408 for _, item in backlog[1:])  # type: ignore[union-attr,index]
    assert body.exhausted
    assert await body.next_backlog() is None


async def test_closing_a_body_wakes_its_waiting_reader() -> None:
    sender, receiver = open_output_channel("r0")
    body = Body(
        [
            RequestStream(
                rid="r0", prompt_tokens=1, receiver=receiver, abort=lambda: None, sender=sender
            )
        ]
    )
    got: list[object] = []

    async def read() -> None:
        got.append(await body.next_backlog())

    with trio.fail_after(10):  # a reader nobody wakes would wait for ever
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            body.close()
    assert got == [None]


async def test_a_stream_closed_elsewhere_fails_the_body_and_it_does_not_end_as_whole(
    tributary_engine: Engine,
) -> None:
    """Nothing more comes from a stream closed by someone other than the body, so the
    response cannot be completed: the body's task raises (no [DONE], no usage), as when a
    frame fails to render, rather than wait for ever or end as if whole."""
    sampling = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1000})
    streams = [
        tributary_engine.submit(GenerateRequest(text=text, sampling=sampling))
        for text in ("one", "two")
    ]
    body = Body(streams)
    async with body:
        assert await body.next_backlog()
        streams[1].close()  # not the body's own close
        with trio.fail_after(5), pytest.raises(RuntimeError, match="closed before its end"):
            while True:
                await body.next_backlog()
    await wait_engine_idle(tributary_engine)  # both requests were aborted


async def test_a_multiplexed_body_yields_before_each_chunk_whether_ready_or_awaited() -> None:
    # The delivery contract (`StreamedBody.__anext__`): a body yields before each chunk. A
    # multiplexed body whose items already wait yields through `__anext__`'s checkpoint; one
    # that must wait for delivery yields by parking (`waits_for_chunk`), without the first.
    sender, receiver = open_output_channel("r0")
    stream = RequestStream(
        rid="r0", prompt_tokens=1, receiver=receiver, abort=lambda: None, sender=sender
    )
    body = Body([stream])
    ticks = 0

    async def other_task() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        async with body:
            sender.send(Frame("r0", "a", [1], 1, 1, 0))  # ready before the body asks
            with trio.testing.assert_checkpoints():
                assert await body.__anext__() == b"chunk"

            async def deliver_later() -> None:
                await trio.lowlevel.checkpoint()
                sender.send(Frame("r0", "b", [2], 1, 2, 0))

            nursery.start_soon(deliver_later)
            before = ticks
            with trio.testing.assert_checkpoints():
                assert await body.__anext__() == b"chunk"  # parked until delivery
            assert ticks > before  # the other task ran while it waited
        nursery.cancel_scope.cancel()
