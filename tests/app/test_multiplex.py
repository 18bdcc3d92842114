"""`MultiplexedBody` under cancellation at every point Quart can deliver it.

Found by the disconnect soak (test_soak.py): a client that closed just as its stream's body
was entered made `__aenter__` raise `Cancelled` after it had opened the pumps' nursery. A
context manager whose `__aenter__` raises never gets `__aexit__`, so the nursery stayed open
and Trio reported "Nursery stack corrupted" (Hypercorn logged it as an ASGI error).
"""

from __future__ import annotations

import pytest
import trio

from tributary.app.multiplex import MultiplexedBody
from tributary.engine import Engine, GenerateRequest, SamplingParams
from tributary.testing import wait_engine_idle


class Body(MultiplexedBody):
    async def __anext__(self) -> bytes:
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
