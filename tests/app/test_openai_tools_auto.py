"""`tool_choice: auto` end to end: a server started with `--tool-call-parser hermes` reads the
model's output for calls, unary and streamed, on the real model and a real socket.

SmolLM2's template has no tool syntax, so the model would never write a call by itself; the
request's `regex` (SGLang's extra, allowed beside `auto`) makes it write a Hermes call after
some text, token by token as any model would. What is tested is everything after the model:
detokenized output through the parser, held-back marker text in the stream, the message, the
deltas and `finish_reason`. The parsers' formats themselves have unit tests on canned text
(the parsers' own tests)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
from apphelpers import Server, running_server, server_settings
from openaihelpers import MODEL_CONFIG, model_name
from test_openai_tools import TOOLS

pytestmark = pytest.mark.model

SAID = "Let me check."
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)
#: A regular expression matching exactly SAID + CALL.
FORCE = (
    'Let me check\\.<tool_call>\\n\\{"name": "get_weather", "arguments": '
    '\\{"city": "Paris", "unit": "celsius"\\}\\}\\n</tool_call>'
)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@asynccontextmanager
async def served_with(**settings: Any) -> AsyncIterator[tuple[Server, openai.AsyncOpenAI]]:
    """The real model served with `settings` (a parser), and an official client for it."""
    async with running_server(MODEL_CONFIG, server_settings(**settings)) as server:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60
        )
        async with client:
            yield server, client


@pytest.fixture
async def hermes() -> AsyncIterator[tuple[Server, openai.AsyncOpenAI]]:
    async with served_with(tool_call_parser="hermes") as served:
        yield served


def request(server: Server, **extra: Any) -> dict[str, Any]:
    return {
        "model": model_name(server),
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 80,
        "extra_body": {"regex": FORCE},
        **extra,
    }


async def test_auto_output_is_read_for_calls(hermes: tuple[Server, openai.AsyncOpenAI]) -> None:
    server, client = hermes
    reply = await client.chat.completions.create(**request(server))
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == SAID
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}

    stream = await client.chat.completions.create(**request(server), stream=True)
    content, arguments, names, finish = "", "", [], []
    async for chunk in stream:
        [c] = chunk.choices
        content += c.delta.content or ""
        for delta in c.delta.tool_calls or []:
            assert delta.index == 0 and delta.function is not None
            if delta.function.name is not None:
                names.append(delta.function.name)
            arguments += delta.function.arguments or ""
        if c.finish_reason is not None:
            finish.append(c.finish_reason)
    assert "<" not in content, "no part of the call's marker leaks into the content"
    assert content == choice.message.content
    assert names == ["get_weather"] and arguments == call.function.arguments
    assert finish == ["tool_calls"]


async def test_tool_choice_none_and_no_tools_leave_the_text_alone(
    hermes: tuple[Server, openai.AsyncOpenAI],
) -> None:
    server, client = hermes
    without_tools = request(server)
    del without_tools["tools"]
    for body in (request(server, tool_choice="none"), without_tools):
        reply = await client.chat.completions.create(**body)
        [choice] = reply.choices
        assert choice.message.tool_calls is None
        assert choice.message.content == SAID + CALL
        assert choice.finish_reason == "stop"


async def test_no_parallel_calls_keeps_the_first_of_several(
    hermes: tuple[Server, openai.AsyncOpenAI],
) -> None:
    server, client = hermes
    second = CALL.replace("Paris", "Oslo")
    twice = request(
        server,
        parallel_tool_calls=False,
        extra_body={"regex": FORCE + FORCE[len("Let me check\\.") :].replace("Paris", "Oslo")},
    )
    reply = await client.chat.completions.create(**twice)
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []  # clients rely on at most one
    assert json.loads(call.function.arguments)["city"] == "Paris"
    assert second not in (choice.message.content or "")
    stream = await client.chat.completions.create(**twice, stream=True)
    deltas = [delta async for chunk in stream for delta in chunk.choices[0].delta.tool_calls or []]
    assert {d.index for d in deltas} == {0}
    assert [d.function.name for d in deltas if d.function and d.function.name] == ["get_weather"]
    # With parallel calls allowed, both are made.
    both = await client.chat.completions.create(**{**twice, "parallel_tool_calls": True})
    assert len(both.choices[0].message.tool_calls or []) == 2
