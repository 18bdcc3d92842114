"""Latency and cancellation timing on the in-memory Quart-Trio client under `autojump_clock`:
the sim runner sleeps on Trio's clock, so every expected value below is exact, computed from
the same SimLatency numbers the scheduler pays."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from apphelpers import greedy, parse_sse

from tributary import app, engine
from tributary.engine import EngineConfig, SimLatency

LAT = SimLatency(step_base=0.010, decode_per_seq=0.002, prefill_per_token=0.001)


def step_cost(decoding: int = 0, prefill: int = 0) -> float:
    return LAT.step_base + LAT.decode_per_seq * decoding + LAT.prefill_per_token * prefill


@pytest.fixture
async def eng() -> AsyncIterator[engine.Engine]:
    """An engine on the sim runner; tests using it must request `autojump_clock` themselves
    (pytest-trio only passes a clock to trio.run when the test function asks for it)."""
    config = EngineConfig(runner="sim", sim_latency=LAT, context_length=4096)
    async with engine.open_engine(config) as eng:
        yield eng


async def post(quart_app: Any, body: dict[str, Any]) -> tuple[int, str]:
    """POST /generate on the in-memory client, reading the body chunk by chunk.

    (`test_client().post()` deadlocks on a response of more than 10 chunks: its connection
    waits for the app to finish before draining a 10-slot channel the app is blocked on.)
    """
    chunks: list[bytes] = []
    async with quart_app.test_client().request(
        "/generate", method="POST", headers={"content-type": "application/json"}
    ) as conn:
        await conn.send(json.dumps(body).encode())
        await conn.send_complete()
        try:
            while True:
                chunks.append(await conn.receive())
        except trio.EndOfChannel:
            pass
    return conn.status_code, b"".join(chunks).decode()


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


async def test_queueing_counts_toward_latency(autojump_clock: trio.abc.Clock) -> None:
    # One running slot: the second prompt waits for the first, and its latency says so.
    config = EngineConfig(runner="sim", sim_latency=LAT, max_running_requests=1)
    async with engine.open_engine(config) as eng:
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


async def test_long_stream_is_not_cut_by_quart_response_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    # 70 steps of one virtual second each: longer than Quart's 60 s RESPONSE_TIMEOUT default.
    slow = SimLatency(step_base=1.0, decode_per_seq=0.0, prefill_per_token=0.0)
    async with engine.open_engine(EngineConfig(runner="sim", sim_latency=slow)) as eng:
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
    body = json.dumps({"text": "hello", "stream": True, "sampling_params": greedy(1000)})
    # Quart-Trio's test connection hangs on exit after a mid-stream disconnect
    # (trio-stack-notes 5.2); the outer scope is the documented way out.
    with trio.CancelScope() as scope:
        async with quart_app.test_client().request(
            "/generate", method="POST", headers={"content-type": "application/json"}
        ) as conn:
            await conn.send(body.encode())
            await conn.send_complete()
            for _ in range(3):
                assert (await conn.receive()).startswith(b"data: ")
            assert eng.stats().running == 1
            steps_at_close = eng.stats().steps
            await conn.disconnect()
            while eng.stats().running:
                await trio.sleep(0.0001)
            scope.cancel()
    # The step in flight at the close finishes; the sequence is gone at the next boundary.
    assert eng.stats().steps - steps_at_close <= 1
    assert eng.stats().kv_used_cells == 0
