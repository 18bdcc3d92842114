"""Latency and cancellation timing on the in-memory client (`tributary.testing.AppClient`)
under `autojump_clock`: the sim runner sleeps on Trio's clock, so every expected value below
is exact, computed from the same SimLatency numbers the scheduler pays."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from apphelpers import greedy, parse_sse

from tributary import app, engine
from tributary.engine import SimLatency
from tributary.testing import AppClient, assert_engine_idle, step_time, wait_engine_idle

LAT = SimLatency(step_base=0.010, decode_per_seq=0.002, prefill_per_token=0.001)
#: 70 steps of one virtual second each: longer than Quart's 60 s RESPONSE_TIMEOUT default.
SLOW = SimLatency(step_base=1.0, decode_per_seq=0.0, prefill_per_token=0.0)

# The plugin's engine (`tributary_engine`), on LAT; tests using it must request
# `autojump_clock` themselves (pytest-trio only passes a clock to trio.run when the test
# function asks for it).
pytestmark = pytest.mark.tributary_config(sim_latency=LAT)


def step_cost(decoding: int = 0, prefill: int = 0) -> float:
    return step_time(LAT, decoding=decoding, prefill=prefill)


@pytest.fixture
def eng(tributary_engine: engine.Engine) -> engine.Engine:
    return tributary_engine


async def post(quart_app: Any, body: dict[str, Any]) -> tuple[int, str]:
    """POST /generate on the in-memory client, reading the whole body."""
    response = await AppClient(quart_app).post("/generate", body)
    return response.status, response.text


# "hello": step 1 prefills 5 tokens and samples token 1; steps 2 and 3 decode one token each.
HELLO_3 = step_cost(prefill=5) + 2 * step_cost(decoding=1)


async def test_unary_latency_is_the_virtual_generation_time(
    eng: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    status, body = await post(app.create_app(eng), {"text": "hello", "sampling_params": greedy(3)})
    assert status == 200
    assert json.loads(body)["meta_info"]["e2e_latency"] == pytest.approx(HELLO_3, abs=1e-9)


async def test_each_batch_item_measures_its_own_end(
    eng: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    body = {"text": ["hello", "hi"], "sampling_params": [greedy(3), greedy(1)]}
    status, text = await post(app.create_app(eng), body)
    assert status == 200
    long, short = json.loads(text)
    # Step 1 prefills both prompts (7 tokens): "hi" is done; "hello" decodes two more steps.
    first = step_cost(prefill=7)
    assert short["meta_info"]["e2e_latency"] == pytest.approx(first, abs=1e-9)
    expected_long = first + 2 * step_cost(decoding=1)
    assert long["meta_info"]["e2e_latency"] == pytest.approx(expected_long, abs=1e-9)


@pytest.mark.tributary_config(max_running_requests=1, prefix_cache_mb=0)  # (both prefill)
async def test_queueing_counts_toward_latency(
    eng: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    # One running slot: the second prompt waits for the first, and its latency says so.
    body = {"text": ["hello", "hello"], "sampling_params": greedy(3)}
    _, text = await post(app.create_app(eng), body)
    first, second = (item["meta_info"]["e2e_latency"] for item in json.loads(text))
    assert first == pytest.approx(HELLO_3, abs=1e-9)
    assert second == pytest.approx(2 * HELLO_3, abs=1e-9)


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_stream_terminal_latency_is_the_virtual_generation_time(
    eng: engine.Engine, autojump_clock: trio.abc.Clock, incremental: bool
) -> None:
    settings = app.ServerSettings(incremental_streaming_output=incremental)
    body = {"text": "hello", "stream": True, "sampling_params": greedy(3)}
    status, text = await post(app.create_app(eng, settings), body)
    assert status == 200
    events = parse_sse(text)
    assert events[-1] == "[DONE]"
    frames = events[:-1]
    assert len(frames) == 3
    assert all("e2e_latency" not in f["meta_info"] for f in frames[:-1])
    assert frames[-1]["meta_info"]["e2e_latency"] == pytest.approx(HELLO_3, abs=1e-9)


@pytest.mark.tributary_config(sim_latency=SLOW)
async def test_long_stream_is_not_cut_by_quart_response_timeout(
    eng: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    quart_app = app.create_app(eng)
    for stream in (True, False):
        start = trio.current_time()
        body = {"text": "x", "stream": stream, "sampling_params": greedy(70)}
        with trio.fail_after(100):  # virtual seconds: a cut stream fails, not hangs
            status, text = await post(quart_app, body)
        assert status == 200
        final = parse_sse(text)[-2] if stream else json.loads(text)
        assert final["meta_info"]["completion_tokens"] == 70
        assert trio.current_time() - start == pytest.approx(70.0)


async def test_disconnect_frees_the_sequence_at_the_next_step(
    eng: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    quart_app = app.create_app(eng)
    body = {"text": "hello", "stream": True, "sampling_params": greedy(1000)}
    async with AppClient(quart_app).stream("POST", "/generate", json=body) as conn:
        for _ in range(3):
            assert (await conn.receive()).startswith(b"data: ")
        assert eng.stats().running == 1
        steps_at_close = eng.stats().steps
        await conn.disconnect()
        await wait_engine_idle(eng)
    # The step in flight at the close finishes; the sequence is gone at the next boundary.
    assert eng.stats().steps - steps_at_close <= 1
    assert_engine_idle(eng)
