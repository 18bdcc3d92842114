"""Engine faults: the sim runner fails a step while 4 sequences run, one per response shape.
Each of the 4 gets a 500 in its own shape (a unary status and body, a batch entry, a stream's
error item before `[DONE]`, OpenAI's error object); the next requests succeed and nothing
leaks. In memory, under `autojump_clock`.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from tributary.app import create_app
from tributary.engine import Engine
from tributary.testing import (
    AppClient,
    AppResponse,
    assert_engine_idle,
    fail_step,
    server_settings,
    wait_engine_idle,
)

LONG = {"temperature": 0, "max_new_tokens": 500}
V1_LONG = {"prompt": "hi", "max_tokens": 500, "temperature": 0}

# (name, path, body, sequences it runs); each group runs 4 sequences together.
Shape = tuple[str, str, dict[str, Any], int]
CUMULATIVE: list[Shape] = [
    ("generate unary", "/generate", {"text": "a", "sampling_params": LONG}, 1),
    ("generate stream", "/generate", {"text": "b", "sampling_params": LONG, "stream": True}, 1),
    ("v1 unary", "/v1/completions", V1_LONG, 1),
    ("v1 stream", "/v1/completions", {**V1_LONG, "stream": True}, 1),
]
INCREMENTAL: list[Shape] = [
    ("generate batch", "/generate", {"text": ["c", "d"], "sampling_params": LONG}, 2),
    (
        "generate incremental stream",
        "/generate",
        {"text": "e", "sampling_params": LONG, "stream": True},
        1,
    ),
    (
        "generate stream batch",
        "/generate",
        {"text": ["f"], "sampling_params": LONG, "stream": True},
        1,
    ),
]


def check_failed(name: str, reply: AppResponse) -> None:
    injected = "injected failure"
    if name in ("generate unary", "v1 unary"):
        assert reply.status == 500, reply.text
        error = reply.json()["error"]
        assert injected in error["message"]
        if name.startswith("generate"):
            assert error["code"] == 500
        else:
            assert error["type"] == "server_error"
        return
    assert reply.status == 200
    if name == "generate batch":
        items = reply.json()
        assert [item["error"]["code"] for item in items] == [500, 500]
        return
    events = reply.events()
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert injected in error["message"]
    assert error.get("code") == 500 or error.get("type") == "server_error"
    if name == "generate stream batch":
        assert events[-2]["index"] == 0
    assert len(events) > 2  # output was streamed before the failure


@pytest.mark.parametrize(
    ("shapes", "incremental"), [(CUMULATIVE, False), (INCREMENTAL, True)], ids=["cum", "inc"]
)
async def test_a_failed_step_fails_its_4_sequences_in_every_shape(
    tributary_engine: Engine, autojump_clock: Any, shapes: list[Shape], incremental: bool
) -> None:
    assert sum(s[3] for s in shapes) == 4
    settings = server_settings(incremental_streaming_output=incremental)
    client = AppClient(create_app(tributary_engine, settings))
    replies: dict[str, AppResponse] = {}

    async def send(name: str, path: str, body: dict[str, Any]) -> None:
        replies[name] = await client.post(path, body)

    async with trio.open_nursery() as nursery:
        for name, path, body, _ in shapes:
            nursery.start_soon(send, name, path, body)
        while tributary_engine.stats().running < 4 or tributary_engine.stats().steps < 5:
            await trio.sleep(0.001)
        assert tributary_engine.stats().running == 4
        fail_step(tributary_engine)

    for name, *_ in shapes:
        check_failed(name, replies[name])
    await wait_engine_idle(tributary_engine)
    assert_engine_idle(tributary_engine)
    for name, path, body, _ in shapes:  # the engine serves on
        body = {**body, "sampling_params": {"max_new_tokens": 3}} if "text" in body else body
        after = await client.post(path, {**body, "max_tokens": 3} if "prompt" in body else body)
        assert after.status == 200 and "error" not in after.text, (name, after.text)
    assert (await client.get("/health")).status == 200
    assert_engine_idle(tributary_engine)
