"""`--enable-request-timing`: the phases a terminal `meta_info` carries (and `/v1`'s llama.cpp
`timings`), each exact on the sim runner under `autojump_clock`, for unary requests, batch
items and both stream modes. Off (the default) nothing changes on the wire."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from apphelpers import META_KEYS, greedy, parse_sse

from tributary import app, engine
from tributary.testing import DEFAULT_SIM_LATENCY, AppClient, step_time

pytestmark = pytest.mark.tributary_config(sim_latency=DEFAULT_SIM_LATENCY)

DECODE = step_time(decoding=1)  # 12 ms
HELLO_PREFILL = step_time(prefill=5)  # 15 ms: "hello" alone, first token sampled
HELLO_3 = HELLO_PREFILL + 2 * DECODE
DETAIL_KEYS = [
    "time_to_first_token",
    "queue_time",
    "prefill_time",
    "decode_time",
    "mean_inter_token_latency",
    "decode_throughput",
]


def timed_client(eng: engine.Engine, **settings: Any) -> AppClient:
    return AppClient(
        app.create_app(eng, app.ServerSettings(enable_request_timing=True, **settings))
    )


def check(meta: dict[str, Any], *, queue: float, prefill: float, tokens: int) -> None:
    """The phases of one answer, exactly; they add up to its e2e_latency."""
    assert list(meta) == [*META_KEYS, "e2e_latency", *DETAIL_KEYS]
    decode = (tokens - 1) * DECODE
    expected = {
        "time_to_first_token": queue + prefill,
        "queue_time": queue,
        "prefill_time": prefill,
        "decode_time": decode,
        "mean_inter_token_latency": DECODE if tokens > 1 else None,
        "decode_throughput": 1 / DECODE if tokens > 1 else None,
    }
    for key, want in expected.items():
        assert meta[key] == (None if want is None else pytest.approx(want, abs=1e-9)), key
    assert meta["e2e_latency"] == pytest.approx(queue + prefill + decode, abs=1e-9)
    assert meta["queue_time"] <= meta["time_to_first_token"] <= meta["e2e_latency"]


async def test_off_by_default_responses_are_unchanged(
    tributary_client: AppClient, autojump_clock: trio.abc.Clock
) -> None:
    reply = await tributary_client.post(
        "/generate", {"text": "hello", "sampling_params": greedy(3)}
    )
    assert list(reply.json()["meta_info"]) == [*META_KEYS, "e2e_latency"]
    v1 = await tributary_client.post(
        "/v1/completions", {"prompt": "hello", "max_tokens": 3, "temperature": 0}
    )
    assert "timings" not in v1.json()


async def test_unary(tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock) -> None:
    reply = await timed_client(tributary_engine).post(
        "/generate", {"text": "hello", "sampling_params": greedy(3)}
    )
    check(reply.json()["meta_info"], queue=0.0, prefill=HELLO_PREFILL, tokens=3)


async def test_batch_items_each_have_their_own(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    body = {"text": ["hello", "hi"], "sampling_params": [greedy(3), greedy(1)]}
    long, short = (await timed_client(tributary_engine).post("/generate", body)).json()
    both = step_time(prefill=7)  # one step prefills both prompts and samples both first tokens
    check(long["meta_info"], queue=0.0, prefill=both, tokens=3)
    check(short["meta_info"], queue=0.0, prefill=both, tokens=1)


@pytest.mark.tributary_config(max_running_requests=1, prefix_cache_mb=0)  # (both prefill)
async def test_queue_time_ends_at_admission(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    body = {"text": ["hello", "hello"], "sampling_params": greedy(3)}
    first, second = (await timed_client(tributary_engine).post("/generate", body)).json()
    check(first["meta_info"], queue=0.0, prefill=HELLO_PREFILL, tokens=3)
    # One slot: the second waits for the first to finish, then runs the same steps.
    check(second["meta_info"], queue=HELLO_3, prefill=HELLO_PREFILL, tokens=3)


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_streams_carry_it_on_the_terminal_frame_only(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock, incremental: bool
) -> None:
    client = timed_client(tributary_engine, incremental_streaming_output=incremental)
    body = {"text": ["hello", "hi"], "stream": True, "sampling_params": [greedy(3), greedy(1)]}
    events = parse_sse((await client.post("/generate", body)).text)
    assert events[-1] == "[DONE]"
    finals = {}
    for event in events[:-1]:
        meta = event["meta_info"]
        if meta["finish_reason"] is None:
            assert list(meta) == META_KEYS
        else:
            finals[event["index"]] = meta
    both = step_time(prefill=7)
    check(finals[0], queue=0.0, prefill=both, tokens=3)
    check(finals[1], queue=0.0, prefill=both, tokens=1)


LLAMA_KEYS = [
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
]


def check_llama(timings: dict[str, Any]) -> None:
    """llama.cpp's `timings` for "hello" and 3 tokens: prefill 15 ms, then 24 ms."""
    assert list(timings) == LLAMA_KEYS
    prompt_ms, predicted_ms = HELLO_PREFILL * 1000, 2 * DECODE * 1000
    assert timings == {
        "cache_n": 0,
        "prompt_n": 5,
        "prompt_ms": pytest.approx(prompt_ms),
        "prompt_per_token_ms": pytest.approx(prompt_ms / 5),
        "prompt_per_second": pytest.approx(1e3 / prompt_ms * 5),
        "predicted_n": 3,
        "predicted_ms": pytest.approx(predicted_ms),
        "predicted_per_token_ms": pytest.approx(predicted_ms / 3),
        "predicted_per_second": pytest.approx(1e3 / predicted_ms * 3),
    }


V1 = {"prompt": "hello", "max_tokens": 3, "temperature": 0}


async def test_v1_unary_timings(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    reply = (await timed_client(tributary_engine).post("/v1/completions", V1)).json()
    assert list(reply)[-2:] == ["usage", "timings"]
    check_llama(reply["timings"])


@pytest.mark.parametrize("usage", [True, False], ids=["usage-chunk", "no-usage-chunk"])
async def test_v1_stream_timings_on_the_last_chunk(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock, usage: bool
) -> None:
    body: dict[str, Any] = {**V1, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    events = parse_sse((await timed_client(tributary_engine).post("/v1/completions", body)).text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("timings" not in chunk for chunk in chunks[:-1])
    last = chunks[-1]
    if usage:
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    else:
        assert last["choices"][0]["finish_reason"] == "length"
    check_llama(last["timings"])
