"""Tool calling on `/v1/chat/completions` with the official `openai` client, the real model and
a real Hypercorn: forced (`required`) and named calls that validate against their tools'
schemas, streamed call deltas assembled into the same calls, `parallel_tool_calls=false`, and a
tool-result round trip.

SmolLM2's chat template renders no tools (it writes `message['content']` only), so these calls
are forced by the grammar (SGLang's forced-call schema), which is what makes them valid even
on a 135M model. `auto` with a parser is tested end to end in test_openai_tools_auto.py."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest
from apphelpers import Server
from openaihelpers import model_name

pytest_plugins = ["openaifixtures"]  # model_server, http, aclient

pytestmark = pytest.mark.model

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
#: Nested parameters with `$defs` and `$ref`s (rewritten to where the forced schema holds them).
FLIGHT: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "book_flight",
        "description": "Book a flight",
        "parameters": {
            "type": "object",
            "properties": {
                "from": {"$ref": "#/$defs/airport"},
                "to": {"$ref": "#/$defs/airport"},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["from", "to", "passengers"],
            "additionalProperties": False,
            "$defs": {"airport": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        },
    },
}
TOOLS = [WEATHER, FLIGHT]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 120}
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


def schema_of(name: str) -> dict[str, Any]:
    [tool] = [t for t in TOOLS if t["function"]["name"] == name]
    return tool["function"]["parameters"]  # type: ignore[no-any-return]


def check_call(call: Any, names: set[str]) -> dict[str, Any]:
    """A call as OpenAI sends it, whose arguments validate against its tool's schema."""
    assert CALL_ID.match(call.id), call.id
    assert call.type == "function"
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema_of(call.function.name))
    return arguments  # type: ignore[no-any-return]


async def test_required_and_named_calls_validate(
    aclient: openai.AsyncOpenAI, model_server: Server
) -> None:
    name = model_name(model_server)
    forced = await aclient.chat.completions.create(
        model=name, messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY
    )
    [choice] = forced.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        check_call(call, {"get_weather", "book_flight"})

    named = await aclient.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Book me a flight from Paris to Rome."}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "book_flight"}},
        parallel_tool_calls=False,  # this small model would repeat the call to the budget
        **GREEDY,
    )
    [choice] = named.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        arguments = check_call(call, {"book_flight"})
        assert set(arguments) == {"from", "to", "passengers"}


async def test_no_parallel_calls_gives_exactly_one(
    aclient: openai.AsyncOpenAI, model_server: Server
) -> None:
    reply = await aclient.chat.completions.create(
        model=model_name(model_server),
        messages=[{"role": "user", "content": "Weather in Paris, Rome, Oslo and Lima, please."}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        **GREEDY,
    )
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0], {"get_weather", "book_flight"})


async def test_streamed_call_deltas_assemble_into_the_unary_calls(
    aclient: openai.AsyncOpenAI, model_server: Server
) -> None:
    name = model_name(model_server)
    ask: dict[str, Any] = {
        "model": name,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        **GREEDY,
    }
    unary = await aclient.chat.completions.create(**ask)
    stream = await aclient.chat.completions.create(**ask, stream=True)
    calls: dict[int, dict[str, Any]] = {}
    finish = []
    async for chunk in stream:
        [choice] = chunk.choices
        assert not choice.delta.content, "a forced call sends no content"
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:  # a call's first delta: id, type and name
                assert CALL_ID.match(delta.id or ""), delta
                assert delta.type == "function" and delta.function is not None
                assert delta.function.arguments == ""
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:  # then fragments of the arguments, under the same index
                assert delta.id is None and delta.function is not None
                assert delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments
        if choice.finish_reason is not None:
            finish.append(choice.finish_reason)
    assert finish == ["tool_calls"]
    assert sorted(calls) == list(range(len(calls))) and calls
    assembled = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    for call_name, arguments in assembled:
        assert call_name == "get_weather"
        jsonschema.validate(json.loads(arguments), schema_of(call_name))
    assert unary.choices[0].message.tool_calls is not None
    assert assembled == [
        (c.function.name, c.function.arguments) for c in unary.choices[0].message.tool_calls
    ]


async def test_tool_result_round_trip(aclient: openai.AsyncOpenAI, model_server: Server) -> None:
    name = model_name(model_server)
    first = await aclient.chat.completions.create(
        model=name,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        **GREEDY,
    )
    message = first.choices[0].message
    [call] = message.tool_calls or []
    result = "It is 21 degrees and sunny in Paris."
    history: list[Any] = [
        *ASK,
        message.model_dump(exclude_none=True),  # as clients send the assistant turn back
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    answer = await aclient.chat.completions.create(
        model=name, messages=history, tools=TOOLS, max_tokens=24, temperature=0
    )
    [choice] = answer.choices
    assert choice.message.tool_calls is None  # auto without a parser: the answer is content
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    without_result = await aclient.chat.completions.create(
        model=name, messages=history[:-1], tools=TOOLS, max_tokens=1, temperature=0
    )
    # The tool's answer reached the prompt (SmolLM2's template renders a tool turn's content).
    tokens = len(model_server.eng.tokenize(result, add_special=False))
    assert answer.usage is not None and without_result.usage is not None
    assert answer.usage.prompt_tokens >= without_result.usage.prompt_tokens + tokens


async def test_streamed_calls_of_several_choices_carry_every_logprob(
    aclient: openai.AsyncOpenAI, model_server: Server
) -> None:
    stream = await aclient.chat.completions.create(
        model=model_name(model_server),
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        n=2,
        temperature=0.7,
        seed=1,
        max_tokens=120,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    entries, finish = [0, 0], [None, None]
    arguments = ["", ""]
    usage = None
    async for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        [choice] = chunk.choices
        if choice.logprobs is not None and choice.logprobs.content:
            entries[choice.index] += len(choice.logprobs.content)
        for delta in choice.delta.tool_calls or []:
            assert delta.function is not None
            arguments[choice.index] += delta.function.arguments or ""
        if choice.finish_reason is not None:
            finish[choice.index] = choice.finish_reason  # type: ignore[call-overload]
    assert finish == ["tool_calls", "tool_calls"]
    assert usage is not None and sum(entries) == usage.completion_tokens
    for text in arguments:
        json.loads(text)


async def test_a_forced_call_cut_by_a_stop_string_is_no_call_streamed_or_not(
    aclient: openai.AsyncOpenAI, model_server: Server
) -> None:
    # The grammar writes `[{"name":"get_weather","parameters":{...` whatever the model: the
    # stop string cuts the array after the call's name (which a stream has already sent).
    ask: dict[str, Any] = {
        "model": model_name(model_server),
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "stop": ['"parameters"'],
        **GREEDY,
    }
    unary = await aclient.chat.completions.create(**ask)
    [choice] = unary.choices
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    stream = await aclient.chat.completions.create(**ask, stream=True)
    finish = [c.choices[0].finish_reason async for c in stream if c.choices[0].finish_reason]
    # Not `tool_calls`: a client would run a call whose arguments are not JSON.
    assert finish == ["stop"]
