"""OpenAI's shapes of tool calling and reasoning: `tools`, `tool_choice` and
`reasoning_effort` in, `message.tool_calls` and the stream's deltas out. What is not OpenAI's
wire shape (the forced-call schema, reading calls and reasoning from output) is
app/chat/tools.py's.

Synopsis::

    tools = parse_tools(body.tools)                    # [ToolDefinition, ...]; 400s
    choice = parse_tool_choice(body.tool_choice, tools)
    message_fields(out, reasoning=True)  # {"content", "reasoning_content", ["tool_calls"]}
    call_delta_objects(deltas)           # the `delta.tool_calls` entries of a stream

A call's id is `call_` and 24 hex digits (SGLang's and OpenAI's form).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from ..chat.tool_parsers import ParsedCall, ToolCallDelta
from ..chat.tools import (
    ChatOutput,
    NamedTool,
    ToolChoice,
    ToolDefinition,
    check_tool_choice,
    check_tools,
)
from ..http.errors import InvalidRequest

__all__ = [
    "REASONING_EFFORTS",
    "call_delta_objects",
    "message_fields",
    "new_call_id",
    "parse_reasoning_effort",
    "parse_tool_choice",
    "parse_tools",
]

#: SGLang's `reasoning_effort` tiers (a float in [0, 0.99] is its extension).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

_TOOL_SHAPE = (
    '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'
)
_CHOICE_SHAPE = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tools(raw: Any) -> list[ToolDefinition]:
    """OpenAI's `tools` (null: none). Each entry `{"type": "function", "function": {"name",
    "description", "parameters", "strict"}}`; `parameters` a JSON Schema object."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad_tools(f"tools must be a list of {_TOOL_SHAPE} objects, got {raw!r}.")
    tools = []
    for i, entry in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(entry, dict):
            raise _bad_tools(f"{where} must be an object {_TOOL_SHAPE}.")
        kind = entry.get("type", "function")
        if kind != "function":
            raise _bad_tools(f"{where}.type must be 'function', got {kind!r}.")
        function = entry.get("function")
        if not isinstance(function, dict):
            raise _bad_tools(f"{where}.function is required: {_TOOL_SHAPE}.")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _bad_tools(f"{where}.function.name must be a non-empty string, got {name!r}.")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad_tools(f"{where}.function.description must be a string.")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _bad_tools(
                f"{where}.function.parameters must be a JSON Schema object, got {parameters!r}."
            )
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad_tools(f"{where}.function.strict must be a boolean, got {strict!r}.")
        tools.append(ToolDefinition(name, description, parameters, strict))
    check_tools(tools, param="tools")
    return tools


def parse_tool_choice(raw: Any, tools: Sequence[ToolDefinition]) -> ToolChoice:
    """OpenAI's `tool_choice`; absent or null is `auto` with tools and `none` without
    (OpenAI's and SGLang's default)."""
    if raw is None:
        return "auto" if tools else "none"
    choice: ToolChoice
    if raw in ("none", "auto", "required"):
        choice = raw
    elif (
        isinstance(raw, dict)
        and raw.get("type", "function") == "function"
        and isinstance(raw.get("function"), dict)
        and isinstance(raw["function"].get("name"), str)
    ):
        choice = NamedTool(raw["function"]["name"])
    else:
        raise InvalidRequest(
            f"tool_choice must be {_CHOICE_SHAPE}, got {raw!r}.", param="tool_choice"
        )
    return check_tool_choice(choice, tools, param="tool_choice")


def parse_reasoning_effort(raw: Any) -> str | float | None:
    """SGLang's `reasoning_effort`: one of its tiers, or a number in [0, 0.99]."""
    if raw is None or raw in REASONING_EFFORTS:
        return raw
    if isinstance(raw, int | float) and not isinstance(raw, bool) and 0 <= raw <= 0.99:
        return float(raw)
    raise InvalidRequest(
        "reasoning_effort must be one of "
        + ", ".join(repr(e) for e in REASONING_EFFORTS)
        + f", or a number between 0 and 0.99, got {raw!r}.",
        param="reasoning_effort",
    )


def _bad_tools(message: str) -> InvalidRequest:
    return InvalidRequest(message, param="tools")


def message_fields(out: ChatOutput, *, reasoning: bool) -> dict[str, Any]:
    """A unary choice's `message` past its role: `content` (null when there is none, as
    OpenAI sends beside calls), `reasoning_content` when the server reads reasoning, and
    `tool_calls` when calls were made."""
    fields: dict[str, Any] = {"content": out.content}
    if reasoning:
        fields["reasoning_content"] = out.reasoning
    if out.calls:
        fields["tool_calls"] = [_call_object(call) for call in out.calls]
    return fields


def _call_object(call: ParsedCall) -> dict[str, Any]:
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def call_delta_objects(deltas: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """Each stream entry of `delta.tool_calls`, one per chunk: a call's first entry carries its
    `index`, `id`, `type` and name with `arguments` "", later ones `index` and a fragment of
    `arguments` (OpenAI's stream)."""
    entries: list[dict[str, Any]] = []
    for delta in deltas:
        if delta.name is not None:
            entries.append(
                {
                    "index": delta.index,
                    "id": new_call_id(),
                    "type": "function",
                    "function": {"name": delta.name, "arguments": ""},
                }
            )
        if delta.arguments:
            entries.append({"index": delta.index, "function": {"arguments": delta.arguments}})
    return entries
