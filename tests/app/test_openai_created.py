"""OpenAI's `created` field: the time the completion was made, not the time the server started."""

from __future__ import annotations

import time

import httpx
import trio
from apphelpers import running_server


async def test_openai_created_is_the_completion_time() -> None:
    async with running_server() as server:
        await trio.sleep(1.1)
        async with httpx.AsyncClient(base_url=server.url) as client:
            body = {"prompt": "hi", "max_tokens": 1}
            before = int(time.time())
            created = (await client.post("/v1/completions", json=body)).json()["created"]
            assert created >= before
