"""Overload: three times the engine's capacity (`max_running_requests` +
`max_queued_requests`) at once. The excess is refused at once with a 503 and Retry-After in
each API's error shape, every admitted request completes correctly, and the server is
healthy afterwards. In memory under `autojump_clock`, so "at once" is exact; then once over a
real socket.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from tributary.engine import Engine
from tributary.testing import AppClient, AppResponse, open_server, sim_config, wait_engine_idle

RUNNING, QUEUED = 4, 4
CAPACITY = RUNNING + QUEUED
TOKENS = 20

pytestmark = pytest.mark.tributary_config(max_running_requests=RUNNING, max_queued_requests=QUEUED)

REQUESTS: dict[str, dict[str, Any]] = {
    "/generate": {"text": "hi", "sampling_params": {"temperature": 0, "max_new_tokens": TOKENS}},
    "/v1/completions": {"prompt": "hi", "max_tokens": TOKENS, "temperature": 0},
    "/v1/completions stream": {
        "prompt": "hi",
        "max_tokens": TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
}


#: Over sockets, requests long enough (1 s) that all arrive while the first ones run.
SOCKET_TOKENS = 100
SOCKET_REQUEST = {
    "text": "hi",
    "sampling_params": {"temperature": 0, "max_new_tokens": SOCKET_TOKENS},
}


def completion_tokens(path: str, reply: AppResponse) -> int:
    if path == "/generate":
        tokens: int = reply.json()["meta_info"]["completion_tokens"]
        return tokens
    if path.endswith("stream"):
        return int(reply.events()[-2]["usage"]["completion_tokens"])
    return int(reply.json()["usage"]["completion_tokens"])


def refusal_message(path: str, reply: AppResponse) -> str:
    body = reply.json()
    if path == "/generate":  # SGLang's HTTPException body for a full queue
        assert body["object"] == "error" and body["code"] == 503
        return str(body["message"])
    assert body["error"]["type"] == "server_error"  # OpenAI's shape
    return str(body["error"]["message"])


@pytest.mark.parametrize("case", list(REQUESTS))
async def test_three_times_capacity(
    tributary_engine: Engine, tributary_client: AppClient, autojump_clock: Any, case: str
) -> None:
    path = case.split()[0]
    start = trio.current_time()
    replies: list[tuple[float, AppResponse]] = []

    async def one() -> None:
        reply = await tributary_client.post(path, REQUESTS[case])
        replies.append((trio.current_time() - start, reply))

    async with trio.open_nursery() as nursery:
        for _ in range(3 * CAPACITY):
            nursery.start_soon(one)

    refused = [(t, r) for t, r in replies if r.status == 503]
    admitted = [(t, r) for t, r in replies if r.status != 503]
    assert len(refused) == 2 * CAPACITY and len(admitted) == CAPACITY
    for elapsed, reply in refused:
        assert elapsed == 0  # at once: no step has run yet
        assert reply.headers["retry-after"] == "1"
        assert refusal_message(path, reply) == "The request queue is full."
    for elapsed, reply in admitted:
        assert reply.status == 200 and elapsed > 0
        assert completion_tokens(case, reply) == TOKENS
    await wait_engine_idle(tributary_engine)
    assert (await tributary_client.get("/health")).status == 200
    after = await tributary_client.post(path, REQUESTS[case])
    assert after.status == 200 and completion_tokens(case, after) == TOKENS


async def test_three_times_capacity_over_a_real_socket() -> None:
    config = sim_config(max_running_requests=RUNNING, max_queued_requests=QUEUED)
    async with open_server(config) as server:
        limits = httpx.Limits(max_connections=3 * CAPACITY)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
            replies: list[httpx.Response] = []
            ready = trio.Event()

            async def one() -> None:
                await ready.wait()
                replies.append(await client.post("/generate", json=SOCKET_REQUEST))

            async with trio.open_nursery() as nursery:
                for _ in range(3 * CAPACITY):
                    nursery.start_soon(one)
                ready.set()
            statuses = sorted(r.status_code for r in replies)
            # Sockets do not all arrive before the first step ends: at least the excess over
            # capacity is refused, and everything admitted completes.
            assert statuses.count(503) >= 2 * CAPACITY - RUNNING
            assert set(statuses) == {200, 503}
            for reply in replies:
                if reply.status_code == 503:
                    assert reply.headers["retry-after"] == "1"
                else:
                    assert reply.json()["meta_info"]["completion_tokens"] == SOCKET_TOKENS
            assert (await client.get("/health")).status_code == 200
            await wait_engine_idle(server.engine)
