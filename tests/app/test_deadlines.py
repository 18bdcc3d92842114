"""Per-request deadlines (`--request-timeout`, `X-Request-Timeout`): past it, what still
generates is aborted at once and the client reads a 408 in each response shape; the engine
frees the sequence within a step. In-memory client, sim runner, virtual time."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from apphelpers import FAST, greedy

from tributary import app, engine, testing

#: One decode step of the suite's sim model, alone.
STEP = testing.step_time(FAST, decoding=1)
LONG = greedy(4000)  # 10 s of virtual time: always past the deadlines below


def timed_out(seconds: str) -> dict[str, Any]:
    return {"error": {"message": f"Request timed out after {seconds} s.", "code": 408}}


def header(seconds: str) -> dict[str, str]:
    return {"X-Request-Timeout": seconds}


async def test_a_unary_generate_past_its_deadline_is_a_408_and_frees_its_sequence(
    tributary_client: testing.AppClient,
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    start = trio.current_time()
    body = {"text": "hi", "sampling_params": LONG}
    response = await tributary_client.post("/generate", json=body, headers=header("0.5"))
    assert trio.current_time() - start == pytest.approx(0.5)
    assert (response.status, response.json()) == (408, timed_out("0.5"))
    await testing.wait_engine_idle(tributary_engine, timeout=STEP)
    ok = await tributary_client.post("/generate", json={"text": "hi", "sampling_params": greedy(3)})
    assert ok.status == 200


async def test_a_stream_past_its_deadline_ends_with_a_408_item_then_done(
    tributary_client: testing.AppClient,
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    body = {"text": "hi", "stream": True, "sampling_params": LONG}
    response = await tributary_client.post("/generate", json=body, headers=header("0.25"))
    events = response.events()
    assert response.status == 200
    assert events[-2:] == [timed_out("0.25"), "[DONE]"]
    assert len(events) > 10  # the output before the deadline was streamed
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-2])
    await testing.wait_engine_idle(tributary_engine, timeout=STEP)


async def test_a_batch_past_its_deadline_keeps_the_items_that_finished(
    tributary_client: testing.AppClient,
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    """The deadline covers the whole HTTP request; a batch answers 200 as for any item's
    failure: finished items keep their results, the rest are 408 entries."""
    body = {"text": ["a", "b", "c"], "sampling_params": [greedy(3), LONG, LONG]}
    response = await tributary_client.post("/generate", json=body, headers=header("1"))
    first, *late = response.json()
    assert response.status == 200
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert late == [timed_out("1"), timed_out("1")]
    await testing.wait_engine_idle(tributary_engine, timeout=STEP)


async def test_v1_past_its_deadline_is_an_openai_408(
    tributary_client: testing.AppClient,
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    body = {"prompt": "hi", "max_tokens": 4000, "n": 2}
    unary = await tributary_client.post("/v1/completions", json=body, headers=header("0.5"))
    assert unary.status == 408
    assert unary.json() == {
        "error": {
            "message": "Request timed out after 0.5 s.",
            "type": "timeout_error",
            "param": None,
            "code": None,
        }
    }
    streamed = await tributary_client.post(
        "/v1/completions", json={**body, "stream": True}, headers=header("0.5")
    )
    events = streamed.events()
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "Request timed out after 0.5 s."
    assert events[-2]["error"]["type"] == "timeout_error"
    assert any(e.get("choices") for e in events[:-2])  # text before the deadline
    await testing.wait_engine_idle(tributary_engine, timeout=STEP)


@pytest.mark.tributary_config(max_running_requests=1)
async def test_a_queued_request_times_out_without_ever_running(
    tributary_client: testing.AppClient,
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    eng = tributary_engine
    async with trio.open_nursery() as nursery:
        busy = {"text": "busy", "sampling_params": greedy(1000)}
        nursery.start_soon(tributary_client.post, "/generate", busy)
        while eng.stats().running != 1:
            await trio.sleep(STEP)
        start = trio.current_time()
        queued = {"text": "queued", "sampling_params": greedy(3)}
        response = await tributary_client.post("/generate", json=queued, headers=header("0.2"))
        assert trio.current_time() - start == pytest.approx(0.2)
        assert (response.status, response.json()) == (408, timed_out("0.2"))
        assert eng.stats().waiting == 0 and eng.stats().running == 1
        nursery.cancel_scope.cancel()


async def test_the_server_timeout_applies_and_the_header_only_shortens_it(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    settings = testing.server_settings(request_timeout=0.3)
    client = testing.AppClient(app.create_app(tributary_engine, settings))
    body = {"text": "hi", "sampling_params": LONG}
    for given, expected in ((None, "0.3"), ("0.1", "0.1"), ("60", "0.3")):
        start = trio.current_time()
        headers = {} if given is None else header(given)
        response = await client.post("/generate", json=body, headers=headers)
        assert (response.status, response.json()) == (408, timed_out(expected))
        assert trio.current_time() - start == pytest.approx(float(expected))
    short = await client.post("/generate", json={"text": "hi", "sampling_params": greedy(3)})
    assert short.status == 200


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan", "", "1e999"])
async def test_a_bad_timeout_header_is_a_clear_400(
    tributary_client: testing.AppClient, value: str
) -> None:
    body = {"text": "hi", "sampling_params": greedy(2)}
    message = f"X-Request-Timeout must be a positive number of seconds, got {value!r}."
    response = await tributary_client.post("/generate", json=body, headers=header(value))
    assert (response.status, response.json()) == (400, {"error": {"message": message, "code": 400}})
    v1 = await tributary_client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=header(value)
    )
    assert v1.status == 400 and v1.json()["error"]["message"] == message
    assert (await tributary_client.post("/generate", json=body)).status == 200


def test_settings_refuse_a_timeout_that_is_not_a_positive_number() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="request_timeout"):
            app.ServerSettings(request_timeout=bad)
    with pytest.raises(ValueError, match="max_request_bytes"):
        app.ServerSettings(max_request_bytes=0)
