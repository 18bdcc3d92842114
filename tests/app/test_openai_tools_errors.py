"""Bad tool-calling input is a 400 in OpenAI's shape naming the field (`param`), on the real
model and a real socket, and the server keeps serving; a server will not start with a parser
it does not know. (Each is raised while the body is read or, for a schema llguidance refuses,
while `submit_all` prepares the grammar: before any request is submitted.)"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from apphelpers import Server
from openaihelpers import chat_body
from test_openai_errors import assert_openai_error, assert_still_serving
from test_openai_tools import TOOLS, WEATHER

from tributary import app
from tributary.app.cli import build_parser

pytest_plugins = ["openaifixtures"]  # model_server, http

NAMED = {"type": "function", "function": {"name": "get_weather"}}
#: A valid JSON Schema that llguidance refuses (its regexes have no look-behind).
BROKEN = {
    "type": "function",
    "function": {"name": "broken", "parameters": {"type": "string", "pattern": "(?<=a)b"}},
}


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


#: Parameters that are no JSON Schema: llguidance would ignore the keyword and constrain a
#: forced call to something the client did not mean.
NOT_A_SCHEMA = tool("count", {"type": "object", "properties": {"n": {"maximum": "9"}}})
#: A reference to another document, which this server does not fetch.
REMOTE = tool("fetch", {"type": "object", "properties": {"a": {"$ref": "https://e.com/a.json"}}})

CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("schema-that-does-not-compile", {"tools": [BROKEN], "tool_choice": "required"},
     "do not compile into a forced-call grammar: Invalid json_schema", "tools"),
    *[(f"not-a-schema-{choice}", {"tools": [WEATHER, NOT_A_SCHEMA], "tool_choice": choice},
       "tools[1] ('count'): the parameter schema is not a valid JSON Schema (draft 2020-12): "
       "at $.properties.n.maximum: '9' is not of type 'number'.", "tools")
      for choice in ("none", "auto", "required")],
    ("remote-ref-in-a-forced-call", {"tools": [REMOTE], "tool_choice": "required"},
     "Tool 'fetch': the parameter schema refers to another document ($ref "
     "'https://e.com/a.json' at $.properties.a): this server fetches no schemas", "tools"),
    ("choice-naming-no-tool",
     {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "Tool 'nope' not found in tools list.", "tool_choice"),
    ("required-without-tools", {"tool_choice": "required"},
     "Tools cannot be empty if tool choice is set to required.", "tool_choice"),
    ("named-without-tools", {"tool_choice": NAMED},
     "Tools cannot be empty if tool choice is set to a specific tool.", "tool_choice"),
    ("unknown-choice", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice must be",
     "tool_choice"),
    ("tools-not-a-list", {"tools": {"name": "f"}}, "tools must be a list", "tools"),
    ("tool-without-function", {"tools": [{"type": "function"}]}, "tools[0].function is required",
     "tools"),
    ("tool-without-name", {"tools": [{"type": "function", "function": {"parameters": {}}}]},
     "tools[0].function.name must be a non-empty string", "tools"),
    ("tool-of-another-type", {"tools": [{"type": "web_search", "function": {"name": "f"}}]},
     "tools[0].type must be 'function'", "tools"),
    ("parameters-not-a-schema",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters must be a JSON Schema object", "tools"),
    ("duplicate-names", {"tools": [WEATHER, WEATHER]},
     "the tool name 'get_weather' is already declared by tools[0]", "tools"),
    ("forced-beside-response-format",
     {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined with response_format", "tool_choice"),
    ("parallel-not-a-boolean", {"tools": TOOLS, "parallel_tool_calls": "no"},
     "parallel_tool_calls must be a boolean", "parallel_tool_calls"),
    ("bad-reasoning-effort", {"reasoning_effort": "extreme"}, "reasoning_effort must be one of",
     "reasoning_effort"),
    ("template-kwargs-not-an-object", {"chat_template_kwargs": ["x"]},
     "chat_template_kwargs must be an object", "chat_template_kwargs"),
    ("tool-message-without-call-id",
     {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]},
     "messages[1].tool_call_id is required in a tool message", "messages[1].tool_call_id"),
    ("call-arguments-not-json",
     {"messages": [{"role": "assistant", "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     "function.arguments must be valid JSON", "messages[0].tool_calls[0].function.arguments"),
    ("call-without-function",
     {"messages": [{"role": "assistant", "tool_calls": [{"id": "call_1"}]}]},
     "messages[0].tool_calls[0] must be", "messages[0].tool_calls[0]"),
    ("calls-in-a-user-message",
     {"messages": [{"role": "user", "content": "hi", "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "tool_calls is only allowed in assistant messages", "messages[0].tool_calls"),
]  # fmt: skip


@pytest.mark.model
@pytest.mark.parametrize(
    ("changes", "text", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
async def test_bad_tool_input_is_a_400_naming_the_field(
    http: httpx.AsyncClient, model_server: Server, changes: dict[str, Any], text: str, param: str
) -> None:
    error = assert_openai_error(
        await http.post("/v1/chat/completions", json=chat_body(model_server, **changes)),
        400,
        contains=text,
    )
    assert error["param"] == param
    await assert_still_serving(http, model_server)


def test_an_unknown_parser_is_refused_at_start_up(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["serve", flag, "nope"])
        assert exit_info.value.code == 2
        assert f"argument {flag}: invalid choice: 'nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown parser 'nope'"):
        app.ServerSettings(tool_call_parser="nope")
    args = build_parser().parse_args(
        ["serve", "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"]
    )
    assert (args.tool_call_parser, args.reasoning_parser) == ("qwen25", "qwen3")


@pytest.mark.model
async def test_forced_tools_nested_as_deep_as_a_body_may_be_are_a_400(
    http: httpx.AsyncClient, model_server: Server
) -> None:
    # From the deepest body the server reads down, each is a 400 naming `tools`, none a 500:
    # parameters deeper than a grammar may be are refused when the body is read.
    read = 0
    for depth in range(500, 440, -1):
        parameters = '{"type": "object", "properties": {"x": ' * depth + "{}" + "}}" * depth
        tools = f'[{{"type": "function", "function": {{"name": "f", "parameters": {parameters}}}}}]'
        body = json.dumps(chat_body(model_server, tool_choice="required", tools="TOOLS"))
        reply = await http.post(
            "/v1/chat/completions",
            content=body.replace('"TOOLS"', tools),
            headers={"content-type": "application/json"},
        )
        error = assert_openai_error(reply, 400, contains="nested too deeply")
        if "request body" not in error["message"]:  # the body was read: the tools were judged
            read += 1
            assert error["message"].startswith(
                "tools[0] ('f'): the parameter schema is nested too deeply: "
            )
            assert error["param"] == "tools"
    assert read > 10  # the deepest bodies read, and some shallower
    await assert_still_serving(http, model_server)


@pytest.mark.model
async def test_forced_parameters_the_wrapping_takes_past_the_grammars_depth_are_a_400(
    http: httpx.AsyncClient, model_server: Server
) -> None:
    # 128 levels pass the parameters' check; the forced-call array nests them six deeper.
    parameters: dict[str, Any] = {}
    for _ in range(63):
        parameters = {"type": "object", "properties": {"x": parameters}}
    body = chat_body(model_server, tools=[tool("f", parameters)], tool_choice="required")
    error = assert_openai_error(
        await http.post("/v1/chat/completions", json=body), 400, contains="nested too deeply"
    )
    assert error["message"].startswith(
        "The tools' parameters do not compile into a forced-call grammar: Invalid json_schema"
    )
    assert error["param"] == "tools"
