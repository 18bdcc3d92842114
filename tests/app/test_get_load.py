"""`GET /get_load` as SGLang's routers poll it: SGLang's shape, from the scheduler's live state,
and a client that leaves over a real socket stops counting within one engine step."""

from __future__ import annotations

import httpx
import pytest
import trio
from apphelpers import greedy, wait_until

from tributary import engine
from tributary.engine import SimLatency
from tributary.testing import AppClient, RunningServer

#: Steps long enough that "within one step" is a real bound next to a socket's round trip.
SLOW_STEPS = SimLatency(step_base=0.05, decode_per_seq=0.0, prefill_per_token=0.0)

#: An idle server's answer.
IDLE = [
    {
        "rid": None,
        "http_worker_ipc": None,
        "dp_rank": None,
        "num_reqs": 0,
        "num_waiting_reqs": 0,
        "num_tokens": 0,
    }
]


async def test_an_idle_server_reports_sglangs_shape(tributary_client: AppClient) -> None:
    response = await tributary_client.get("/get_load")
    assert response.status == 200
    assert response.json() == IDLE


@pytest.mark.tributary_config(max_running_requests=1, sim_latency=SLOW_STEPS)
async def test_waiting_requests_count_with_their_prompts(
    tributary_engine: engine.Engine, tributary_client: AppClient, autojump_clock: trio.abc.Clock
) -> None:
    body = {"text": "hello", "stream": True, "sampling_params": greedy(1000)}
    async with tributary_client.stream("POST", "/generate", json=body) as first:
        await first.next_event()  # running: its prompt (5 cells) and one token decoded next
        waiting = {**body, "text": "hey you"}  # 7 prompt tokens, no slot for it
        async with tributary_client.stream("POST", "/generate", json=waiting) as second:
            await wait_until(lambda: tributary_engine.stats().waiting == 1)
            [load] = (await tributary_client.get("/get_load")).json()
            kv = tributary_engine.stats().kv_used_cells
            assert (load["num_reqs"], load["num_waiting_reqs"]) == (2, 1)
            assert load["num_tokens"] == kv + 7
            await second.disconnect()
        [load] = (await tributary_client.get("/get_load")).json()
        assert (load["num_reqs"], load["num_waiting_reqs"]) == (1, 0)


@pytest.mark.tributary_config(sim_latency=SLOW_STEPS)
async def test_a_client_that_leaves_stops_counting_within_one_step(
    tributary_server: RunningServer, tributary_http_client: httpx.AsyncClient
) -> None:
    eng = tributary_server.engine

    async def load() -> dict[str, int]:
        response = await tributary_http_client.get("/get_load")
        assert response.status_code == 200
        [rank] = response.json()
        return rank

    body = {"text": "victim", "stream": True, "sampling_params": greedy(4000)}
    async with httpx.AsyncClient(base_url=tributary_server.url, timeout=30) as victim:
        async with victim.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # generating
            assert (await load())["num_reqs"] == 1
            steps_at_close = eng.stats().steps
        # Leaving the stream closed the connection: that close is all the server gets.
    with trio.fail_after(5):
        while (await load())["num_reqs"]:
            await trio.sleep(0.005)
    assert eng.stats().steps - steps_at_close <= 1
    # Its KV cells are freed at that step boundary too.
    await wait_until(lambda: eng.stats().running == 0)
    assert [await load()] == IDLE
    assert eng.stats().steps - steps_at_close <= 1
