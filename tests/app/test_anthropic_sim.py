"""`/v1/messages` on the sim model, in memory and on Trio's virtual clock: deadlines (a 408, or a
stream's `event: error`), a client that leaves mid-stream, and a model without a template."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from apphelpers import CHAT_TEMPLATE, FAST, ScriptedEngine, chat_sim_runner, sim_config

from tributary import app, engine, testing
from tributary.engine import Done, Frame, Output

STEP = testing.step_time(FAST, decoding=1)
LONG = {"max_tokens": 4000, "messages": [{"role": "user", "content": "hi"}]}


@asynccontextmanager
async def chat_app() -> AsyncIterator[tuple[engine.Engine, testing.AppClient]]:
    """The sim engine with a chat template, and an in-memory client of its app."""
    config = sim_config()
    async with engine.open_engine(config, runner=chat_sim_runner(config)) as eng:
        yield eng, testing.AppClient(app.create_app(eng, testing.server_settings()))


def named_events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in body.decode().removesuffix("\n\n").split("\n\n"):
        name, data = block.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def test_a_stream_past_its_deadline_ends_with_an_error_event(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with chat_app() as (eng, client):
        start = trio.current_time()
        response = await client.post(
            "/v1/messages", json={**LONG, "stream": True}, headers={"X-Request-Timeout": "0.25"}
        )
        assert trio.current_time() - start == pytest.approx(0.25, abs=STEP)
        assert response.status == 200, response.body
        events = named_events(response.body)
        names = [name for name, _ in events]
        assert names[:3] == ["message_start", "content_block_start", "content_block_delta"]
        assert names[-1] == "error" and "message_stop" not in names
        assert events[-1][1]["type"] == "error"
        assert events[-1][1]["error"]["type"] == "timeout_error"
        await testing.wait_engine_idle(eng, timeout=STEP)

        response = await client.post(
            "/v1/messages", json=LONG, headers={"X-Request-Timeout": "0.25"}
        )
        assert response.status == 408
        assert response.json()["error"]["type"] == "timeout_error"
        await testing.wait_engine_idle(eng, timeout=STEP)


async def test_a_client_that_leaves_mid_stream_aborts_its_message(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with chat_app() as (eng, client):
        await client.disconnect_after("/v1/messages", {**LONG, "stream": True}, seconds=0.1)
        await testing.wait_engine_idle(eng, timeout=STEP)
        assert eng.stats().generated_tokens < 200  # unaborted, it would run to 4000


async def test_a_model_without_a_chat_template_is_a_400_that_says_so() -> None:
    async with engine.open_engine(sim_config()) as eng:
        client = testing.AppClient(app.create_app(eng, testing.server_settings()))
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            response = await client.post(path, json=LONG)
            assert response.status == 400
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["message"].startswith("This model has no chat template")


class ScriptedChat(ScriptedEngine):
    """A scripted engine with a chat template and a byte tokenizer: its outputs are exactly
    the texts a test gives, as a model that writes call and thinking markers would."""

    def __init__(self, texts: list[str]) -> None:
        def script(i: int, rid: str) -> list[Output]:
            frames: list[Output] = [
                Frame(rid, text, [0], 3, n + 1, 0) for n, text in enumerate(texts[:-1])
            ]
            stop = {"type": "stop", "matched": 2}
            return [*frames, Done(rid, texts[-1], [2], 3, len(texts), 0, finish_reason=stop)]

        super().__init__(script)
        self.model_info = dataclasses.replace(self.model_info, chat_template=CHAT_TEMPLATE)

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return list(text.encode())

    def detokenize(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])


#: A hermes call and qwen3 thinking, cut mid-marker as a model's tokens would cut them.
THINKING_AND_A_CALL = [
    "<think>The user wants",
    " the weather.</th",
    "ink>Let me check.<tool",
    '_call>\n{"name": "get_weather", "arguments": {"city": ',
    '"Paris"}}\n</tool_call>',
    "",
]
WEATHER = {"name": "get_weather", "input_schema": {"type": "object"}}


async def test_thinking_text_and_a_parsed_call_come_as_blocks_unary_and_streamed() -> None:
    settings = testing.server_settings(tool_call_parser="hermes", reasoning_parser="qwen3")
    client = testing.AppClient(app.create_app(ScriptedChat(THINKING_AND_A_CALL), settings))  # type: ignore[arg-type]
    body = {**LONG, "tools": [WEATHER]}
    message = (await client.post("/v1/messages", json=body)).json()
    [thinking, text, call] = message["content"]
    assert thinking == {
        "type": "thinking",
        "thinking": "The user wants the weather.",
        "signature": "",
    }
    assert text == {"type": "text", "text": "Let me check."}
    assert call["type"] == "tool_use" and call["name"] == "get_weather"
    assert call["input"] == {"city": "Paris"} and call["id"].startswith("toolu_")
    assert message["stop_reason"] == "tool_use"

    events = named_events((await client.post("/v1/messages", json={**body, "stream": True})).body)
    blocks: dict[int, dict[str, Any]] = {}
    order = []
    for name, event in events:
        if name == "content_block_start":
            assert not order or order[-1][0] == "stop"  # one block at a time
            blocks[event["index"]] = dict(event["content_block"])
            order.append(("start", event["index"]))
        elif name == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            kind = delta["type"]
            if kind == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif kind == "text_delta":
                block["text"] += delta["text"]
            elif kind == "input_json_delta":
                block["json"] = block.get("json", "") + delta["partial_json"]
            else:
                assert delta == {"type": "signature_delta", "signature": ""}
        elif name == "content_block_stop":
            order.append(("stop", event["index"]))
    assert order == [
        ("start", 0),
        ("stop", 0),
        ("start", 1),
        ("stop", 1),
        ("start", 2),
        ("stop", 2),
    ]
    assert blocks[0] == {"type": "thinking", "thinking": "The user wants the weather."}
    assert blocks[1] == {"type": "text", "text": "Let me check."}  # no partial marker leaked
    assert blocks[2]["name"] == "get_weather" and json.loads(blocks[2]["json"]) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_messages_are_counted_in_metrics_and_the_access_log(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.abc.Clock
) -> None:
    caplog.set_level(logging.INFO, logger="tributary.access")
    async with chat_app() as (_, client):
        body = {"max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
        unary = (await client.post("/v1/messages", json=body)).json()
        streamed = await client.post("/v1/messages", json={**body, "stream": True})
        assert streamed.status == 200
        metrics = (await client.get("/metrics")).text
    assert 'sglang:num_requests_total{model_name="sim"} 2.0' in metrics
    assert 'sglang:generation_tokens_total{model_name="sim"} 6.0' in metrics
    assert (
        'sglang:http_responses_total{endpoint="/v1/messages",method="POST",model_name="sim",'
        'status_code="200"} 2.0'
    ) in metrics
    records = [r.__dict__["access"] for r in caplog.records if r.name == "tributary.access"]
    assert [(r["route"], r["status"], r["completion_tokens"]) for r in records] == [
        ("/v1/messages", 200, 3),
        ("/v1/messages", 200, 3),
    ]
    assert records[0]["rid"] == unary["id"]  # the message id is the engine request's rid
    assert records[1]["rid"].startswith("msg_")


async def test_a_draining_server_refuses_new_messages_as_overloaded() -> None:
    config = sim_config()
    async with engine.open_engine(config, runner=chat_sim_runner(config)) as eng:
        quart_app = app.create_app(eng, testing.server_settings())
        app.server_state(quart_app).draining = True
        response = await testing.AppClient(quart_app).post("/v1/messages", json=LONG)
        assert response.status == 503
        assert response.json() == {
            "type": "error",
            "error": {"type": "overloaded_error", "message": "The server is shutting down."},
        }
        assert eng.stats().generated_tokens == 0


async def test_an_aborted_message_is_a_500_that_clients_do_not_retry(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Anthropic's client retries a 500 (twice by default) unless `x-should-retry: false` says
    not to: without it, an operator's `/abort_request` would only restart the message."""
    async with chat_app() as (eng, client):
        answers: list[testing.AppResponse] = []

        async def ask() -> None:
            answers.append(await client.post("/v1/messages", json=LONG))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await trio.sleep(0.1)
            aborted = await client.post("/abort_request", json={"abort_all": True})
            assert aborted.status == 200
        [response] = answers
        assert response.status == 500
        assert response.headers["x-should-retry"] == "false"
        assert response.json() == {
            "type": "error",
            "error": {"type": "api_error", "message": "Aborted"},
        }
        assert eng.stats().generated_tokens < 200


async def test_answers_read_into_tool_calls_are_logged_and_counted_as_such(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Both APIs, unary and streamed: the access log says finish=tool_calls (what the client
    # was told: OpenAI's finish_reason, Anthropic's stop_reason tool_use) and /metrics counts
    # each such answer in tributary:tool_call_requests.
    caplog.set_level(logging.INFO, logger="tributary.access")
    settings = testing.server_settings(tool_call_parser="hermes", reasoning_parser="qwen3")
    client = testing.AppClient(app.create_app(ScriptedChat(THINKING_AND_A_CALL), settings))  # type: ignore[arg-type]
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]},
    }
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "max_tokens": 50}
    for path, body in (
        ("/v1/messages", {**LONG, "tools": [WEATHER]}),
        ("/v1/chat/completions", chat),
    ):
        for stream in (False, True):
            response = await client.post(path, json={**body, "stream": stream})
            assert response.status == 200, (path, stream)
            assert b"tool_use" in response.body or b"tool_calls" in response.body
    metrics = (await client.get("/metrics")).text
    assert 'tributary:tool_call_requests_total{model_name="scripted"} 4.0' in metrics
    records = [r.__dict__["access"] for r in caplog.records if r.name == "tributary.access"]
    assert [r["finish"] for r in records] == ["tool_calls"] * 4
