"""Deadlines in every SSE shape (/generate cumulative, incremental, batch; the /v1 streams,
which share `ChunkStreamBody`), and a redirected stream whose body is read late: nothing the
engine produced after the deadline reaches the client. In-memory client, sim runner, virtual
time."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from apphelpers import FAST, chat_sim_runner, greedy, sim_config

from tributary import app, engine, testing
from tributary.app.observe.timing import RequestTiming
from tributary.app.sglang.stream import EventStreamBody
from tributary.engine import Frame

STEP = testing.step_time(FAST, decoding=1)
LONG = greedy(4000)


def header(seconds: str) -> dict[str, str]:
    return {"X-Request-Timeout": seconds}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "hi", "stream": True, "sampling_params": LONG}),
        ("/generate", {"text": ["a", "b"], "stream": True, "sampling_params": LONG}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4000, "stream": True, "n": 2}),
    ],
)
async def test_every_stream_shape_ends_at_the_deadline(
    tributary_client: testing.AppClient,
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
    path: str,
    body: dict[str, Any],
) -> None:
    start = trio.current_time()
    response = await tributary_client.post(path, json=body, headers=header("0.25"))
    took = trio.current_time() - start
    assert response.status == 200, response.body
    events = response.events()
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    assert errors and all("timed out" in e["error"]["message"] for e in errors)
    assert "error" in events[-2]
    assert took == pytest.approx(0.25, abs=STEP)
    await testing.wait_engine_idle(tributary_engine, timeout=STEP)


async def test_incremental_stream_ends_at_the_deadline(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    settings = testing.server_settings(incremental_streaming_output=True)
    client = testing.AppClient(app.create_app(tributary_engine, settings))
    body = {"text": "hi", "stream": True, "sampling_params": LONG}
    start = trio.current_time()
    response = await client.post("/generate", json=body, headers=header("0.25"))
    assert trio.current_time() - start == pytest.approx(0.25, abs=STEP)
    events = response.events()
    assert events[-1] == "[DONE]" and "error" in events[-2]
    await testing.wait_engine_idle(tributary_engine, timeout=STEP)


async def test_a_body_read_late_delivers_nothing_produced_after_its_deadline(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    """A slow reader: the body is not read around the deadline. What the engine produced
    after the deadline must not reach the client (set_deadline: 'Items the engine delivers
    after the deadline are dropped')."""
    sampling = engine.SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 4000})
    stream = tributary_engine.submit(engine.GenerateRequest(text="hi", sampling=sampling))
    deadline = trio.current_time() + 0.25
    stream.set_deadline(deadline)
    delivered: list[tuple[float, Any]] = []

    class Probe(EventStreamBody):
        def on_item(self, index: int, item: Any) -> None:
            delivered.append((trio.current_time(), item))

    body = Probe(
        [stream], RequestTiming.start(None), batch=False, incremental=True, weight_version="w"
    )
    async with body:
        await trio.sleep(0.5)  # the client reads nothing meanwhile (a full socket buffer)
        chunks = [chunk async for chunk in body]
    text = b"".join(chunks).decode()
    events = [json.loads(part[6:]) for part in text.split("\n\n") if part.startswith("data: {")]
    assert text.endswith("data: [DONE]\n\n")
    assert events[-1]["error"]["code"] == 408
    assert all(t <= deadline for t, _ in delivered[:-1])  # only the 408 Done after it
    sent = sum(len(e["output_ids"]) for e in events[:-1])
    assert sent == sum(len(i.output_ids) for _, i in delivered if isinstance(i, Frame))
    assert sent > 0
    await testing.wait_engine_idle(tributary_engine, timeout=STEP)


async def test_a_chat_stream_ends_at_the_deadline(autojump_clock: trio.abc.Clock) -> None:
    config = sim_config()
    async with engine.open_engine(config, runner=chat_sim_runner(config)) as eng:
        client = testing.AppClient(app.create_app(eng, testing.server_settings()))
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4000,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = trio.current_time()
        response = await client.post("/v1/chat/completions", json=body, headers=header("0.25"))
        assert trio.current_time() - start == pytest.approx(0.25, abs=STEP)
        assert response.status == 200, response.body
        events = response.events()
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "timeout_error"
        assert all("error" not in e for e in events[:-2]) and len(events) > 3
        await testing.wait_engine_idle(eng, timeout=STEP)
