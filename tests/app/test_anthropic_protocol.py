"""Parsing `/v1/messages` bodies: Anthropic's fields onto the template's messages and the
engine's sampling, and the first fault of a bad body worded with the field it names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tributary.app.anthropic.protocol import parse_count_tokens_body, parse_messages_body
from tributary.app.chat.template import ChatTemplate
from tributary.engine import BadRequest

VOCAB = 1000
HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TOOL_CHOICE_KINDS = (
    "tool_choice must be an object whose type is one of 'auto', 'any', 'tool', 'none', "
)


def parse(**body: Any) -> Any:
    return parse_messages_body({"max_tokens": 8, "messages": HI, **body}, vocab_size=VOCAB)


def test_fields_map_onto_the_template_and_the_engine() -> None:
    req = parse(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "x"},
                    {"type": "text", "text": "c"},
                ],
            },
            {"role": "user", "content": "d"},
        ],
        stop_sequences=["END"],
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        stream=True,
        metadata={"user_id": "u"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        tool_choice={"type": "none"},
    )
    assert req.chat == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c", "reasoning_content": "hmm"},
        {"role": "user", "content": "d"},
    ]
    assert req.prefill == "" and req.stream and req.model is None
    assert req.stop_sequences == ("END",)
    assert req.tools is None and req.output is None
    assert req.extra == {"enable_thinking": True, "thinking": True}
    sampling = req.sampling
    assert sampling.max_new_tokens == 8 and sampling.stop == ("END",)
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.9, 40)


def test_a_last_assistant_message_is_a_prefill() -> None:
    req = parse(messages=[*HI, {"role": "assistant", "content": "The answer is"}], system="S")
    assert req.chat == [{"role": "system", "content": "S"}, *HI]
    assert req.prefill == "The answer is"
    counted = parse_count_tokens_body({"messages": [*HI, {"role": "assistant", "content": "x"}]})
    assert counted.chat == HI and counted.prefill == "x"


GEMMA3 = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "gemma-3-it.jinja"


def test_consecutive_messages_of_one_role_are_one_turn() -> None:
    """Anthropic merges consecutive same-role messages; templates that require alternating
    roles (Gemma 3's, Mistral's) would refuse them unmerged."""
    req = parse(
        messages=[
            {"role": "user", "content": "Hi."},
            {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
            {"role": "assistant", "content": "It is"},
            {"role": "assistant", "content": [{"type": "text", "text": "four,"}]},
        ]
    )
    assert req.chat == [{"role": "user", "content": "Hi.\nWhat is 2+2?"}]
    assert req.prefill == "It is\nfour,"
    gemma = ChatTemplate(GEMMA3.read_text(), bos_token="<bos>", eos_token="<eos>")
    assert "Hi.\nWhat is 2+2?" in gemma.render(req.chat)

    # A tool result and the user's next words sent as two user messages: one turn.
    split = parse(
        tools=[WEATHER],
        messages=[
            *HI,
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
            {"role": "user", "content": "Thanks."},
        ],
    )
    assert [m["role"] for m in split.chat] == ["user", "assistant", "tool", "user"]
    assert split.chat[-1] == {"role": "user", "content": "Thanks."}


def test_claude_codes_billing_stamp_does_not_change_the_prompt() -> None:
    """Claude Code's per-request `cch=` stamp would end the prefix cache's reuse at the first
    line of every prompt (llama-server normalizes it the same way)."""

    def system(stamp: str) -> list[dict[str, str]]:
        header = (
            f"x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch={stamp};"
        )
        return [{"type": "text", "text": header}, {"type": "text", "text": "You are Claude Code."}]

    first, second = parse(system=system("a5145")).chat[0], parse(system=system("0b9e2")).chat[0]
    assert first == second
    assert first["content"].endswith("cch=fffff;\nYou are Claude Code.")
    untouched = "Quote: x-anthropic-billing-header: cch=a5145;"  # not at a line's start
    assert parse(system=untouched).chat[0]["content"] == untouched


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": None}, "max_tokens is required."),
        ({"max_tokens": -1}, "max_tokens must be an integer of at least 0, got -1."),
        ({"max_tokens": 1.5}, "max_tokens must be an integer of at least 0, got 1.5."),
        ({"messages": None}, "messages is required."),
        ({"messages": {"role": "user"}}, "messages must be a non-empty list of messages."),
        ({"messages": ["hi"]}, "messages[0] must be an object."),
        (
            {"messages": [{"role": "user", "content": None}]},
            "messages[0].content must be a string or a list of content blocks, got None.",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            'messages[0].content[0] must be a text block {"type": "text", "text": ...}, got '
            "{'type': 'text', 'text': 3}.",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages[0].content[0]: document content blocks are not supported: this server's "
            "model reads text only.",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t1",
                                "content": [
                                    {"type": "text", "text": "The screenshot:"},
                                    {"type": "image", "source": {"type": "base64", "data": ""}},
                                ],
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0].content[1]: image content blocks are not supported: this "
            "server's model reads text only.",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
            "messages[0].content[0]: content block type 'audio' is not supported by this server "
            "(text, tool_use, tool_result and thinking are).",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages[0].content[0] is not a valid tool_result block: Object missing required "
            "field `tool_use_id`.",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]},
            "messages[0].content[0]: a thinking block cannot be in a user message.",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}],
                    }
                ]
            },
            "messages[0].content[0]: a tool_result block cannot be in an assistant message.",
        ),
        ({"system": 3}, "system must be a string or a list of text blocks, got 3."),
        ({"stop_sequences": "END"}, "stop_sequences must be a list of strings, got 'END'."),
        ({"stream": "yes"}, "stream must be a boolean, got 'yes'."),
        (
            {"tool_choice": {"type": "any"}},
            "tool_choice {'type': 'any'} forces a tool call, but tools declares none.",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
            "Tool 'nope' not found in tools list.",
        ),
        ({"tools": [WEATHER], "tool_choice": "any"}, TOOL_CHOICE_KINDS + "got 'any'."),
        (
            {"tools": [WEATHER, WEATHER]},
            "tools[1]: the tool name 'get_weather' is already declared by tools[0].",
        ),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools[0]: tool type 'web_search_20250305' is not supported: this server runs no "
            "tools of its own; declare client tools ({name, description, input_schema}).",
        ),
        (
            {"tools": [{"name": "f"}]},
            "tools[0] must be a tool {name, description, input_schema}: Object missing "
            "required field `input_schema`.",
        ),
        (
            {"thinking": {"type": "enabled"}},
            "thinking.budget_tokens must be an integer, got None.",
        ),
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
    ],
)
def test_a_bad_body_is_a_400_naming_its_first_fault(body: dict[str, Any], message: str) -> None:
    raw = {"max_tokens": 8, "messages": HI, **body}
    raw = {k: v for k, v in raw.items() if v is not None or k == "messages"}
    if raw.get("messages") is None:
        del raw["messages"]
    with pytest.raises(BadRequest) as info:
        parse_messages_body(raw, vocab_size=VOCAB)
    assert info.value.message == message


def test_a_body_that_is_not_an_object_is_a_400() -> None:
    with pytest.raises(BadRequest) as info:
        parse_messages_body([1], vocab_size=VOCAB)
    assert info.value.message == "The request body must be a JSON object."


def test_tools_map_onto_the_template_and_a_forced_call_is_constrained() -> None:
    req = parse(tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    calling = req.tools
    assert calling is not None and calling.forced and not calling.parallel
    assert calling.template_tools() == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    assert req.sampling.json_schema == calling.constraint()
    schema = json.loads(req.sampling.json_schema or "")
    assert schema["maxItems"] == 1  # disable_parallel_tool_use: one call at most
    assert not req.sampling.skip_special_tokens  # call markers may be special tokens
    assert req.output is not None

    named = parse(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}).tools
    assert named is not None and named.forced and named.parallel
    auto = parse(tools=[WEATHER]).tools  # auto by default: no parser, so the output is text
    assert auto is not None and not auto.forced and auto.template_tools() is not None
    assert parse(tools=[WEATHER]).sampling.json_schema is None
    assert parse(tools=[WEATHER]).output is None
    assert parse(tools=[WEATHER], tool_choice={"type": "none"}).tools is None


def test_tool_use_and_tool_result_blocks_become_the_templates_messages() -> None:
    req = parse(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    assert req.chat == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert req.prefill == ""


def test_thinking_sets_the_templates_switch_and_the_reasoning_read() -> None:
    body = {"max_tokens": 8, "messages": HI, "thinking": {"type": "disabled"}}
    off = parse_messages_body(body, vocab_size=VOCAB, reasoning_parser="qwen3")
    assert off.extra == {"enable_thinking": False, "thinking": False}
    assert off.output is not None and off.output.reasoning is not None
    assert not off.output.reasoning.thinking
    left = parse_messages_body({**body, "thinking": None}, vocab_size=VOCAB)
    assert left.extra is None and left.output is None
