"""A client that goes away over a real socket takes its engine work with it.

For each request shape (unary, stream, unary batch, stream batch): a victim starts long
generations next to a bystander's stream, then closes its connection. The victim's sequences
must leave the engine within one step of the close (the abort is synchronous; the scheduler
drops marked sequences at the next step boundary; we allow one more step for the close to
reach the server), and the bystander's output must be complete and correct.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import trio
from apphelpers import Server, greedy, parse_sse, wait_until

from tributary.testing import assert_engine_idle

BYSTANDER_TOKENS = 300
LONG = greedy(100_000 // 40)  # would take seconds; the test ends long before


async def unary(client: httpx.AsyncClient, texts: Any) -> None:
    await client.post("/generate", json={"text": texts, "sampling_params": LONG})


async def stream(client: httpx.AsyncClient, texts: Any) -> None:
    body = {"text": texts, "stream": True, "sampling_params": LONG}
    async with client.stream("POST", "/generate", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                await trio.sleep_forever()  # streaming has begun; hold the connection


Victim = Callable[[httpx.AsyncClient, Any], Awaitable[None]]


@pytest.mark.parametrize(
    ("victim", "texts"),
    [(unary, "victim"), (stream, "victim"), (unary, ["v0", "v1"]), (stream, ["v0", "v1"])],
    ids=["unary", "stream", "unary-batch", "stream-batch"],
)
async def test_disconnect_aborts_within_one_step(
    sim_server: Server, victim: Victim, texts: Any
) -> None:
    eng = sim_server.eng
    victims = 1 if isinstance(texts, str) else len(texts)
    bystander_result: list[str] = []

    async def bystander() -> None:
        async with httpx.AsyncClient(base_url=sim_server.url, timeout=30) as client:
            body = {
                "text": "bystander",
                "stream": True,
                "sampling_params": greedy(BYSTANDER_TOKENS),
            }
            response = await client.post("/generate", json=body)
            bystander_result.append(response.text)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(bystander)
        await wait_until(lambda: eng.stats().running == 1)
        async with httpx.AsyncClient(base_url=sim_server.url, timeout=30) as client:
            async with trio.open_nursery() as victim_nursery:
                victim_nursery.start_soon(victim, client, texts)
                await wait_until(lambda: eng.stats().running == 1 + victims)
                await wait_until(lambda: eng.stats().generated_tokens > 20)  # mid-generation
                steps_at_close = eng.stats().steps
                # Cancelling an httpx request or leaving its stream closes the connection:
                # that close is all the server gets.
                victim_nursery.cancel_scope.cancel()
        await wait_until(lambda: eng.stats().running == 1)
        assert eng.stats().steps - steps_at_close <= 2
        assert not bystander_result  # the bystander was still generating after the abort

    events = parse_sse(bystander_result[0])
    assert events[-1] == "[DONE]"
    final = events[-2]["meta_info"]
    assert final["completion_tokens"] == BYSTANDER_TOKENS
    assert final["finish_reason"] == {"type": "length", "length": BYSTANDER_TOKENS}
    assert_engine_idle(eng)
