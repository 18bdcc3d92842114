"""Tool calling's pure parts, without a model: SGLang's forced-call schema, reading the forced
array as it streams, the template's `tools=` and extra variables, what `parse_chat` makes of
the tool and reasoning fields, and reading output for reasoning and calls together."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tributary.app.chat.messages import parse_messages
from tributary.app.chat.template import ChatTemplate
from tributary.app.chat.tools import (
    ForcedCalls,
    NamedTool,
    OutputSetup,
    ReasoningSetup,
    ToolCalling,
    ToolDefinition,
    forced_call_schema,
)
from tributary.app.openai.protocol import parse_chat

WEATHER = ToolDefinition("get_weather", "w", {"type": "object", "properties": {"c": {}}})
ADD = ToolDefinition("add", None, None)


def item(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def test_forced_call_schema_is_sglangs() -> None:
    empty = {"type": "object", "properties": {}}
    assert forced_call_schema([WEATHER, ADD], "required", parallel=True) == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [item("get_weather", WEATHER.parameters or {}), item("add", empty)],
        },
    }
    one = forced_call_schema([WEATHER, ADD], NamedTool("add"), parallel=False)
    assert one == {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", **item("add", empty)},
        "maxItems": 1,
    }
    assert forced_call_schema([WEATHER], "auto", parallel=True) is None


ARRAY = '[{"name":"a","parameters":{"s":"x\\"}]","n":[1,{"b":2}]}}, {"parameters":{},"name":"b"}]'


def test_forced_calls_stream_as_they_parse() -> None:
    content, calls = ForcedCalls().parse(ARRAY)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [
        ("a", '{"s":"x\\"}]","n":[1,{"b":2}]}'),
        ("b", "{}"),  # parameters before the name: sent once the name is known
    ]
    for arguments in (c.arguments for c in calls):
        json.loads(arguments)
    reader = ForcedCalls()
    deltas = [d for ch in ARRAY for d in reader.feed(ch)[1]] + reader.finish()[1]
    assert [d.name for d in deltas if d.name is not None] == ["a", "b"]
    assert all(d.arguments == "" for d in deltas if d.name is not None)  # the first of a call
    joined = ["".join(d.arguments for d in deltas if d.index == i) for i in (0, 1)]
    assert joined == [c.arguments for c in calls]


@pytest.mark.parametrize("text", [ARRAY[:-5], "[0]", "no calls", ""])
def test_forced_output_that_is_no_call_stays_content(text: str) -> None:
    assert ForcedCalls().parse(text) == (text, [])


def test_template_gets_tools_and_extra_variables() -> None:
    source = (
        "{% for t in tools %}[{{ t.function.name }}:{{ t.function.parameters | tojson }}]"
        "{% endfor %}{{ enable_thinking }}/{{ reasoning_effort }}|"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.x }})"
        "{% endfor %}{{ m.tool_call_id or '' }};{% endfor %}"
    )
    template = ChatTemplate(source, bos_token="", eos_token="")
    messages = parse_messages(
        [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 7}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "8"},
        ]
    )
    calling = ToolCalling((WEATHER, ADD), NamedTool("get_weather"))
    text = template.render(
        messages,
        tools=calling.template_tools(),
        extra={"enable_thinking": False, "reasoning_effort": "low"},
    )
    assert text == (
        '[get_weather:{"type": "object", "properties": {"c": {}}}]False/low|'
        "user:hi;assistant:f(7);tool:8c1;"
    )


def test_a_template_for_bare_functions_gets_them_on_a_second_try() -> None:
    source = (
        "{% if tools[0].function is defined %}{{ raise_exception('bare functions only') }}"
        "{% endif %}{{ tools[0].name }}"
    )
    template = ChatTemplate(source, bos_token="", eos_token="")
    calling = ToolCalling((WEATHER,), "auto")
    assert template.render([], tools=calling.template_tools()) == "get_weather"


def chat(**body: Any) -> Any:
    return parse_chat(
        {"messages": [{"role": "user", "content": "x"}], **body},
        vocab_size=1000,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
    )


def test_parse_chat_maps_tools_and_reasoning_fields() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    plain = parse_chat({"messages": [{"role": "user", "content": "x"}]}, vocab_size=1000)
    assert (plain.tools, plain.template_extra, plain.output) == (None, None, None)
    assert plain.sampling.skip_special_tokens is True

    auto = chat(tools=tools)
    assert auto.tools is not None and auto.tools.choice == "auto" and auto.tools.parses
    assert auto.sampling.skip_special_tokens is False  # SGLang: call markers may be special
    assert auto.sampling.json_schema is None
    assert chat(tools=tools, skip_special_tokens=True).sampling.skip_special_tokens is True
    assert chat(tools=tools, tool_choice="none").sampling.skip_special_tokens is True

    forced = chat(tools=tools, tool_choice="required", parallel_tool_calls=False)
    assert json.loads(forced.sampling.json_schema)["maxItems"] == 1

    off = chat(reasoning_effort="none")
    assert off.template_extra == {
        "reasoning_effort": "none",
        "thinking": False,
        "enable_thinking": False,
    }
    assert off.output is not None and off.output.reasoning == ReasoningSetup(
        "qwen3", thinking=False
    )
    kept = chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert kept.output is not None and kept.output.reasoning is not None
    assert kept.output.reasoning.thinking is False  # "thinking" is still set false
    moved = chat(chat_template_kwargs={"reasoning_effort": "high", "x": 1})
    assert moved.template_extra == {"reasoning_effort": "high", "x": 1}
    assert chat(separate_reasoning=False).output is None


def test_reasoning_then_calls_are_read_from_one_output() -> None:
    calling = ToolCalling((WEATHER,), "auto", parser="hermes")
    setup = OutputSetup(calling, ReasoningSetup("qwen3"))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"c": 1}}\n</tool_call>'
    text = "<think>cold?</think>Checking." + call
    out = setup.split(text)
    assert (out.reasoning, out.content) == ("cold?", "Checking.")
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"c": 1})]
    stream = setup.stream()
    deltas = [stream.feed(ch) for ch in text] + [stream.finish()]
    assert "".join(d.reasoning for d in deltas) == "cold?"
    assert "".join(d.content for d in deltas) == "Checking."
    assert [c.name for d in deltas for c in d.calls] == ["get_weather"] and stream.called
    # A forced call's grammar holds from the first token: never read for reasoning.
    forced = OutputSetup(ToolCalling((WEATHER,), "required"), ReasoningSetup("deepseek-r1"))
    out = forced.split('[{"name":"get_weather","parameters":{}}]')
    assert out.reasoning is None and [c.name for c in out.calls] == ["get_weather"]
