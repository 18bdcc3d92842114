"""Anthropic's Messages API (`/v1/messages`) with the real model on a real Hypercorn socket: the
unary and streamed shapes, the prompt the template gets, stop reasons, the errors, the API key,
and the official `anthropic` client reading all of it."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest
import trio
from apphelpers import Server, running_server
from openaihelpers import MODEL_CONFIG, model_name

from tributary.app.chat.template import ChatTemplate
from tributary.testing import server_settings

pytest_plugins = ["openaifixtures"]  # model_server, http

pytestmark = pytest.mark.model

QUESTION = [{"role": "user", "content": "What is 2+2?"}]
SYSTEM = "You answer in one short sentence."
MESSAGE_KEYS = ["id", "type", "role", "content", "model", "stop_reason", "stop_sequence", "usage"]


def request(server: Server, **extra: Any) -> dict[str, Any]:
    """A greedy request for the question, with room to finish its turn."""
    return {
        "model": model_name(server),
        "max_tokens": 64,
        "temperature": 0,
        "messages": QUESTION,
        **extra,
    }


def events_of(text: str) -> list[tuple[str, dict[str, Any]]]:
    """An Anthropic SSE body as (event name, data) pairs; fails on any other framing."""
    assert text.endswith("\n\n"), text[-80:]
    events = []
    for block in text[:-2].split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == name.removeprefix("event: "), block
        events.append((payload["type"], payload))
    return events


def prompt_size(server: Server, chat: list[dict[str, str]], prefill: str = "") -> int:
    """The tokens of `chat` as the model's own template renders it (plus a prefill's)."""
    template = ChatTemplate.for_engine(server.eng)
    assert template is not None
    ids = server.eng.tokenize(template.render(chat), add_special=False)
    return len(ids) + (len(server.eng.tokenize(prefill, add_special=False)) if prefill else 0)


def prompt_tokens(usage: dict[str, int]) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"]


async def test_a_unary_message_has_anthropics_shape(
    model_server: Server, http: httpx.AsyncClient
) -> None:
    response = await http.post("/v1/messages", json=request(model_server))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    message = response.json()
    assert list(message) == MESSAGE_KEYS
    assert message["id"].startswith("msg_") and len(message["id"]) > 20
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["model"] == model_name(model_server)
    [block] = message["content"]
    assert list(block) == ["type", "text"] and block["type"] == "text"
    assert "4" in block["text"]
    # The model ends its turn well within 64 tokens: its end-of-turn token is end_turn.
    assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None
    usage = message["usage"]
    assert list(usage) == ["input_tokens", "cache_read_input_tokens", "output_tokens"]
    assert prompt_tokens(usage) == prompt_size(model_server, QUESTION)
    assert 0 < usage["output_tokens"] < 64

    counted = await http.post("/v1/messages/count_tokens", json=request(model_server))
    assert counted.status_code == 200
    assert counted.json() == {"input_tokens": prompt_tokens(usage)}


async def test_the_system_prompt_and_a_prefill_reach_the_template(
    model_server: Server, http: httpx.AsyncClient
) -> None:
    with_system = [{"role": "system", "content": SYSTEM}, *QUESTION]
    expected = prompt_size(model_server, with_system)
    # SmolLM2's template writes a default system prompt of its own when there is none.
    assert expected != prompt_size(model_server, QUESTION)
    for system in (SYSTEM, [{"type": "text", "text": SYSTEM}]):
        response = await http.post("/v1/messages", json=request(model_server, system=system))
        assert response.status_code == 200, response.text
        assert prompt_tokens(response.json()["usage"]) == expected

    prefill = "The answer to this"
    chat = [*QUESTION, {"role": "assistant", "content": prefill}]
    response = await http.post("/v1/messages", json=request(model_server, messages=chat))
    assert response.status_code == 200, response.text
    message = response.json()
    assert prompt_tokens(message["usage"]) == prompt_size(model_server, QUESTION, prefill)
    # The answer continues the prefill: it does not start the turn over.
    assert not message["content"][0]["text"].startswith(prefill)


async def test_stop_sequences_and_max_tokens_set_the_stop_reason(
    model_server: Server, http: httpx.AsyncClient
) -> None:
    whole = (await http.post("/v1/messages", json=request(model_server))).json()
    text = whole["content"][0]["text"]
    words = text.split(" ")
    stop = " " + words[len(words) // 2]
    body = request(model_server, stop_sequences=["never in this answer", stop])
    stopped = (await http.post("/v1/messages", json=body)).json()
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == stop
    assert stopped["content"] == [{"type": "text", "text": text[: text.index(stop)]}]

    streamed = await http.post("/v1/messages", json={**body, "stream": True})
    *_, (_, end), _ = events_of(streamed.text)
    assert end["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}

    short = (await http.post("/v1/messages", json=request(model_server, max_tokens=3))).json()
    assert short["stop_reason"] == "max_tokens" and short["stop_sequence"] is None
    assert short["usage"]["output_tokens"] == 3


async def test_a_stream_sends_anthropics_events_that_add_up_to_the_unary_answer(
    model_server: Server, http: httpx.AsyncClient
) -> None:
    unary = (await http.post("/v1/messages", json=request(model_server))).json()
    response = await http.post("/v1/messages", json=request(model_server, stream=True))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = events_of(response.text)
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 2
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert list(start) == MESSAGE_KEYS and start["id"].startswith("msg_")
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {**unary["usage"], "output_tokens": 0}
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    text = ""
    for _, event in events[2 : 2 + deltas]:
        assert event["index"] == 0 and event["delta"]["type"] == "text_delta"
        text += event["delta"]["text"]
    assert text == unary["content"][0]["text"]  # greedy: the same answer
    assert events[-3][1] == {"type": "content_block_stop", "index": 0}
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": unary["stop_reason"], "stop_sequence": None},
        "usage": {"output_tokens": unary["usage"]["output_tokens"]},
    }
    assert events[-1][1] == {"type": "message_stop"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_tokens": None}, "max_tokens is required."),
        (
            {"messages": [{"role": "bot", "content": "hi"}]},
            "messages[0].role must be one of 'user', 'assistant', got 'bot'.",
        ),
        (
            {"messages": [{"role": "system", "content": "hi"}]},
            'messages[0].role: unexpected role "system". The Messages API takes a top-level '
            '`system` field, not "system" as a message role.',
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}},
                        ],
                    }
                ]
            },
            "messages[0].content[1]: image content blocks are not supported: this server's "
            "model reads text only.",
        ),
        ({"messages": []}, "messages must be a non-empty list of messages."),
        ({"max_tokens": "16"}, "max_tokens must be an integer of at least 0, got '16'."),
        (
            {"max_tokens": 4096},
            "max_tokens is too large: 4096. This model supports at most 2048 tokens.",
        ),
        (
            {
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "tool", "name": "g"},
            },
            "Tool 'g' not found in tools list.",
        ),
    ],
)
async def test_bad_input_is_a_400_in_anthropics_shape(
    model_server: Server, http: httpx.AsyncClient, change: dict[str, Any], message: str
) -> None:
    body = {k: v for k, v in {**request(model_server), **change}.items() if v is not None}
    for stream in (False, True):
        response = await http.post("/v1/messages", json={**body, "stream": stream})
        assert response.status_code == 400, response.text
        assert response.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }


async def test_another_model_and_a_wrong_method_answer_in_anthropics_shape(
    model_server: Server, http: httpx.AsyncClient
) -> None:
    response = await http.post("/v1/messages", json=request(model_server, model="claude-x"))
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "not_found_error"
    assert "claude-x" in error["message"] and model_name(model_server) in error["message"]
    response = await http.get("/v1/messages")
    assert response.status_code == 405
    assert response.json()["type"] == "error"


async def test_the_api_key_is_taken_from_x_api_key_or_bearer() -> None:
    async with running_server(MODEL_CONFIG, server_settings(api_key="sekret")) as server:
        body = {"messages": QUESTION}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            for headers in ({"x-api-key": "sekret"}, {"Authorization": "Bearer sekret"}):
                response = await http.post("/v1/messages/count_tokens", json=body, headers=headers)
                assert response.status_code == 200, headers
            assert (
                await http.get("/v1/models", headers={"x-api-key": "sekret"})
            ).status_code == 200
            for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
                response = await http.post("/v1/messages", json=body, headers=headers)
                assert response.status_code == 401
                assert response.json() == {
                    "type": "error",
                    "error": {
                        "type": "authentication_error",
                        "message": "Incorrect API key provided.",
                    },
                }

        def call(key: str) -> Any:
            client = anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)
            return client.messages.count_tokens(model=model_name(server), messages=QUESTION)

        assert (await trio.to_thread.run_sync(call, "sekret")).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError):
            await trio.to_thread.run_sync(call, "wrong")


async def test_the_official_client_reads_messages_streams_and_errors(model_server: Server) -> None:
    client = anthropic.Anthropic(base_url=model_server.url, api_key="none", max_retries=0)
    name = (await trio.to_thread.run_sync(client.models.list)).data[0].id
    assert name == model_name(model_server)
    greedy: dict[str, Any] = {"extra_body": {"temperature": 0}}

    def unary() -> Any:
        return client.messages.create(
            model=name, max_tokens=64, system=SYSTEM, messages=QUESTION, **greedy
        )

    def streamed() -> tuple[list[str], Any, list[str]]:
        with client.messages.stream(
            model=name, max_tokens=64, system=SYSTEM, messages=QUESTION, **greedy
        ) as stream:
            types = []
            texts = []
            for event in stream:
                types.append(event.type)
                if event.type == "text":
                    texts.append(event.text)
            return texts, stream.get_final_message(), types

    message = await trio.to_thread.run_sync(unary)
    assert message.type == "message" and message.role == "assistant" and message.model == name
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    [block] = message.content
    assert block.type == "text" and block.text
    assert message.usage.output_tokens > 0

    texts, final, types = await trio.to_thread.run_sync(streamed)
    assert "".join(texts) == block.text
    assert final.content[0].text == block.text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == message.usage.output_tokens
    assert final.usage.input_tokens == message.usage.input_tokens
    assert types[0] == "message_start" and types[-1] == "message_stop"

    counted = await trio.to_thread.run_sync(
        lambda: client.messages.count_tokens(model=name, system=SYSTEM, messages=QUESTION)
    )
    assert counted.input_tokens == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0
    )

    def image() -> Any:
        source = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
        content = [{"type": "image", "source": source}]
        return client.messages.create(
            model=name, max_tokens=8, messages=[{"role": "user", "content": content}]
        )

    with pytest.raises(anthropic.BadRequestError) as bad:
        await trio.to_thread.run_sync(image)
    assert "image content blocks are not supported" in bad.value.message
    with pytest.raises(anthropic.NotFoundError):
        await trio.to_thread.run_sync(
            lambda: client.messages.create(model="claude-x", max_tokens=8, messages=QUESTION)
        )


WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_weather(arguments: Any) -> bool:
    return (
        isinstance(arguments, dict)
        and set(arguments) == {"city", "unit"}
        and isinstance(arguments["city"], str)
        and arguments["unit"] in ("celsius", "fahrenheit")
    )


@pytest.mark.parametrize(
    "choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=["any", "tool"]
)
async def test_a_forced_tool_call_follows_the_tools_schema_unary_and_streamed(
    model_server: Server, http: httpx.AsyncClient, choice: dict[str, Any]
) -> None:
    body = request(
        model_server,
        max_tokens=128,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice={**choice, "disable_parallel_tool_use": True},
    )
    message = (await http.post("/v1/messages", json=body)).json()
    assert message["stop_reason"] == "tool_use", message
    [call] = message["content"]  # one call: parallel use disabled
    assert list(call) == ["type", "id", "name", "input"]
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
    assert call["name"] == "get_weather" and valid_weather(call["input"])

    events = events_of((await http.post("/v1/messages", json={**body, "stream": True})).text)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    start = events[1][1]["content_block"]
    assert start["type"] == "tool_use" and start["name"] == "get_weather"
    assert start["input"] == {} and start["id"].startswith("toolu_")
    fragments = [e["delta"] for n, e in events if n == "content_block_delta"]
    assert fragments and all(f["type"] == "input_json_delta" for f in fragments)
    assert json.loads("".join(f["partial_json"] for f in fragments)) == call["input"]  # greedy
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_a_tool_result_round_trip_with_the_official_client(model_server: Server) -> None:
    client = anthropic.Anthropic(base_url=model_server.url, api_key="none", max_retries=0)
    name = model_name(model_server)

    def ask(messages: list[Any], **extra: Any) -> Any:
        return client.messages.create(
            model=name,
            max_tokens=128,
            messages=messages,
            tools=[WEATHER],  # type: ignore[list-item]
            extra_body={"temperature": 0},
            **extra,
        )

    def stream_call() -> Any:
        with client.messages.stream(
            model=name,
            max_tokens=128,
            messages=ASK_WEATHER,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "any"},
            extra_body={"temperature": 0},
        ) as stream:
            return stream.get_final_message()

    first = await trio.to_thread.run_sync(lambda: ask(ASK_WEATHER, tool_choice={"type": "any"}))
    assert first.stop_reason == "tool_use"
    calls = [block for block in first.content if block.type == "tool_use"]
    assert calls and all(c.name == "get_weather" and valid_weather(c.input) for c in calls)
    streamed = await trio.to_thread.run_sync(stream_call)
    assert [(b.name, b.input) for b in streamed.content] == [(c.name, c.input) for c in calls]

    results = [
        {"type": "tool_result", "tool_use_id": c.id, "content": "Sunny, 21 degrees"} for c in calls
    ]
    history = [
        *ASK_WEATHER,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": results},
    ]
    answer = await trio.to_thread.run_sync(lambda: ask(history))
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in answer.content] == ["text"]
    # The template got the call and its result: the prompt holds both.
    counted = await trio.to_thread.run_sync(
        lambda: client.messages.count_tokens(model=name, messages=history, tools=[WEATHER])  # type: ignore[list-item]
    )
    without = await trio.to_thread.run_sync(
        lambda: client.messages.count_tokens(model=name, messages=ASK_WEATHER, tools=[WEATHER])  # type: ignore[list-item]
    )
    assert counted.input_tokens > without.input_tokens + 10


async def test_a_forced_call_with_a_schema_that_cannot_compile_is_a_400(
    model_server: Server, http: httpx.AsyncClient
) -> None:
    # A valid JSON Schema that llguidance cannot compile (a lookbehind in a pattern).
    pattern = {"type": "string", "pattern": "(?<=a)b"}
    broken = {**WEATHER, "input_schema": {"type": "object", "properties": {"x": pattern}}}
    body = request(model_server, tools=[broken], tool_choice={"type": "any"})
    response = await http.post("/v1/messages", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(
        "The tools' input schemas do not compile into a forced-call grammar: Invalid json"
    )
