"""Anthropic's tools on the API-neutral tool calling of `app/chat/tools.py`.

Synopsis::

    calling = parse_tools(body.tools, body.tool_choice, parser=settings.tool_call_parser)
    calling.template_tools()       # the template's `tools=` (None: none)
    calling.constraint()           # forced calls (`any`, `tool`): the output's json_schema
    tool_use_block(call)           # {"type": "tool_use", "id": "toolu_...", "name", "input"}

Mapping (llama-server's `convert_anthropic_to_oai`, with SGLang's names on our side): a tool
`{name, description, input_schema}` is a function whose parameters are `input_schema`;
`tool_choice` `auto` is `auto` (calls are read by the server's `--tool-call-parser`; without
one the output is text), `any` is `required` and `{"type": "tool", "name"}` a named tool (both
forced: llguidance holds the output to the tools' schemas, so the calls always parse), `none`
renders no tools. `disable_parallel_tool_use` allows at most one call. Tools of Anthropic's
own (`type` other than `custom`: web search, bash, ...) are a 400: this server runs none.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from ..chat.tool_parsers import ParsedCall
from ..chat.tools import (
    NamedTool,
    ToolCalling,
    ToolChoice,
    ToolDefinition,
    check_tool_choice,
    check_tools,
)
from ..http.errors import InvalidRequest
from .models import AnthropicTool

__all__ = ["new_tool_use_id", "object_type", "parse_tools", "tool_input", "tool_use_block"]

_CHOICES = ("auto", "any", "tool", "none")
#: Anthropic's tool choices by SGLang's (OpenAI's) names.
_NAMES: dict[str, ToolChoice] = {"auto": "auto", "any": "required", "none": "none"}


def parse_tools(tools: Any, choice: Any, *, parser: str | None) -> ToolCalling | None:
    """The request's tool calling (None: no tools, or `tool_choice` none); 400s name the field."""
    definitions = [_tool(i, raw) for i, raw in enumerate(tools or [])]
    check_tools(definitions, param="tools")
    named, parallel = _choice(choice)
    if not definitions and named not in ("auto", "none"):
        raise InvalidRequest(
            f"tool_choice {choice!r} forces a tool call, but tools declares none.",
            param="tool_choice",
        )
    picked = check_tool_choice(named, definitions, param="tool_choice")
    if not definitions or picked == "none":
        return None
    return ToolCalling(tuple(definitions), picked, parallel=parallel, parser=parser)


def _tool(i: int, raw: Any) -> ToolDefinition:
    where = f"tools[{i}]"
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in (None, "custom"):
        raise InvalidRequest(
            f"{where}: tool type {kind!r} is not supported: this server runs no tools of its "
            "own; declare client tools ({name, description, input_schema}).",
            param="tools",
        )
    try:
        tool = msgspec.convert(raw, AnthropicTool)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(
            f"{where} must be a tool {{name, description, input_schema}}: {exc}.", param="tools"
        ) from None
    return ToolDefinition(tool.name, tool.description, tool.input_schema)


def _choice(raw: Any) -> tuple[ToolChoice, bool]:
    """(the tool choice in SGLang's names, whether calls may be parallel)."""
    if raw is None:
        return "auto", True
    kind = object_type("tool_choice", raw, _CHOICES)
    single = raw.get("disable_parallel_tool_use")
    if single is not None and not isinstance(single, bool):
        raise InvalidRequest(
            f"tool_choice.disable_parallel_tool_use must be a boolean, got {single!r}.",
            param="tool_choice",
        )
    if kind == "tool":
        name = raw.get("name")
        if not isinstance(name, str):
            raise InvalidRequest(
                f"tool_choice.name must be a string naming a tool, got {name!r}.",
                param="tool_choice",
            )
        return NamedTool(name), not single
    return _NAMES[kind], not single


def object_type(field: str, raw: Any, kinds: tuple[str, ...]) -> str:
    """The `type` of an object field that must be one of `kinds` (Anthropic's option objects:
    `tool_choice`, `thinking`), or the 400 naming them."""
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in kinds:
        raise InvalidRequest(
            f"{field} must be an object whose type is one of {', '.join(map(repr, kinds))}, "
            f"got {raw!r}.",
            param=field,
        )
    return str(kind)


def new_tool_use_id() -> str:
    """A call's id, in Anthropic's form (`toolu_` and 24 characters)."""
    return f"toolu_{uuid.uuid4().hex[:24]}"


def tool_input(call: ParsedCall) -> dict[str, Any]:
    """The call's arguments as Anthropic's `input` object ({} if they are not one: a call cut
    short by max_tokens, as llama-server answers)."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_block(call: ParsedCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": new_tool_use_id(),
        "name": call.name,
        "input": tool_input(call),
    }
