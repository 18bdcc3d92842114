"""A `/v1` client that leaves early aborts its generation at once, and only its own."""

from __future__ import annotations

import httpx
import openai
import pytest
import trio
from apphelpers import Server, wait_until
from openaihelpers import chat_body, model_name

pytest_plugins = ["openaifixtures"]  # model_server, http, aclient

pytestmark = pytest.mark.model

# Far more tokens than the test can wait for: only an abort ends these requests in time.
ENDLESS = 1500


async def test_streaming_chat_disconnect_aborts_while_another_request_completes(
    aclient: openai.AsyncOpenAI, model_server: Server
) -> None:
    eng = model_server.eng
    name = model_name(model_server)
    other: list[str] = []

    async def another_request() -> None:
        reply = await aclient.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "What is 2+2?"}],
            max_tokens=16,
            temperature=0,
        )
        other.append(reply.choices[0].message.content or "")

    async with trio.open_nursery() as nursery:
        stream = await aclient.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=ENDLESS,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        received = []
        async with stream:
            async for chunk in stream:
                received.append(chunk.choices[0].delta.content or "")
                if len(received) == 3:
                    assert eng.stats().running == 1
                    nursery.start_soon(another_request)
                    break
        # Leaving `async with stream` closed its connection: the server sees the disconnect.
    assert "4" in other[0]
    # Unaborted, the stream would decode for many seconds more.
    await wait_until(lambda: eng.stats().running == 0, timeout=2)
    assert eng.stats().generated_tokens < 200


async def test_unary_disconnect_aborts(model_server: Server) -> None:
    eng = model_server.eng
    async with httpx.AsyncClient(base_url=model_server.url, timeout=60) as client:
        body = chat_body(model_server, max_tokens=ENDLESS, ignore_eos=True)
        with trio.move_on_after(0.5) as scope:
            await client.post("/v1/chat/completions", json=body)
        assert scope.cancelled_caught
        assert eng.stats().running == 1 or eng.stats().waiting == 1
        await wait_until(lambda: eng.stats().running == 0 and eng.stats().waiting == 0, timeout=2)
        tokens = eng.stats().generated_tokens
        assert 0 < tokens < 200
        ok = await client.post("/v1/chat/completions", json=chat_body(model_server))
        assert "4" in ok.json()["choices"][0]["message"]["content"]
