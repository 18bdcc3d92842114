"""`/v1/messages` and `/v1/messages/count_tokens` request bodies, declared once.

Synopsis::

    body, pending = convert_pending(raw, MessagesBody, words)     # tributary.engine.wire
    body.messages, body.max_tokens, body.stop_sequences

The Structs are the single list of fields these endpoints read: protocol.py converts a body
through them and applies Anthropic's rules, `/openapi.json` publishes their JSON Schema
(app/openapi.py), and tests/app/test_anthropic_docs.py holds docs/api.md to them. Unknown
keys are ignored, as llama-server does. A message and its content blocks are declared too
(`AnthropicMessage`, the blocks): the messages are converted through them in one call when
they are well formed, and block by block, for the first fault's words, when not.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

__all__ = [
    "ROLES",
    "SCHEMAS",
    "AnthropicMessage",
    "AnthropicTool",
    "Block",
    "CountTokensBody",
    "MessagesBody",
    "RedactedThinkingBlock",
    "TextBlock",
    "ThinkingBlock",
    "ToolResultBlock",
    "ToolUseBlock",
]

#: The roles of Anthropic's messages (the system prompt is the top-level `system`).
ROLES = ("user", "assistant")

_REF = "#/components/schemas/{}"
_IGNORED = "Accepted and ignored."


def _doc(description: str, **schema: Any) -> Meta:
    return Meta(description=description, extra_json_schema=schema or None)


class TextBlock(msgspec.Struct, kw_only=True, tag="text", tag_field="type"):
    text: str
    cache_control: Annotated[Any, _doc(_IGNORED)] = None
    citations: Annotated[Any, _doc(_IGNORED)] = None


class ToolUseBlock(msgspec.Struct, kw_only=True, tag="tool_use", tag_field="type"):
    """An earlier call of the model's, in an assistant message."""

    id: str
    name: str
    input: dict[str, Any]
    cache_control: Annotated[Any, _doc(_IGNORED)] = None


class ToolResultBlock(msgspec.Struct, kw_only=True, tag="tool_result", tag_field="type"):
    """What a call returned, in a user message."""

    tool_use_id: str
    content: Annotated[
        str | list[TextBlock] | None, _doc("A string or text blocks (joined with newlines).")
    ] = None
    is_error: bool | None = None
    cache_control: Annotated[Any, _doc(_IGNORED)] = None


class ThinkingBlock(msgspec.Struct, kw_only=True, tag="thinking", tag_field="type"):
    """An earlier turn's reasoning, sent back as clients keep it: dropped from the prompt."""

    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(
    msgspec.Struct, kw_only=True, tag="redacted_thinking", tag_field="type"
):
    """Dropped from the prompt, as a thinking block is."""

    data: str


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class AnthropicTool(msgspec.Struct, kw_only=True):
    """A client tool the model may call (a `type` other than `custom` is refused)."""

    name: str
    input_schema: Annotated[
        dict[str, Any], Meta(description="The call's `input`: a JSON Schema object.")
    ]
    description: str | None = None
    type: Annotated[str | None, Meta(description="'custom', or left out.")] = None
    cache_control: Annotated[Any, _doc(_IGNORED)] = None


class AnthropicMessage(msgspec.Struct, kw_only=True):
    """One turn: `user` or `assistant`. Image and document blocks are refused (a 400 that says
    so): the model reads text only."""

    role: Annotated[str, Meta(extra_json_schema={"enum": list(ROLES)})]
    content: Annotated[
        str | list[Block],
        Meta(description="A string, or content blocks (text ones joined with newlines)."),
    ]


_MESSAGES = _doc(
    "The conversation, at least one message; a last assistant message is continued.",
    type="array",
    items={"$ref": _REF.format("AnthropicMessage")},
    minItems=1,
)
_SYSTEM = Annotated[
    str | list[TextBlock] | None,
    _doc("The system prompt: a string or text blocks (joined with newlines)."),
]


class CountTokensBody(msgspec.Struct, kw_only=True):
    """What `/v1/messages/count_tokens` reads: the prompt's fields."""

    model: Annotated[str | None, _doc("The served model's name; may be left out.")] = None
    messages: Annotated[Any, _MESSAGES] = None
    system: _SYSTEM = None
    tools: Annotated[
        Any,
        _doc(
            "Client tools the model may call.",
            type="array",
            items={"$ref": _REF.format("AnthropicTool")},
        ),
    ] = None
    tool_choice: Annotated[
        Any,
        _doc(
            "{'type': 'auto' | 'any' | 'tool' | 'none', 'name' (tool), "
            "'disable_parallel_tool_use'}: default auto; any and tool force calls.",
            type="object",
            required=["type"],
            examples=[{"type": "auto"}],
        ),
    ] = None
    thinking: Annotated[
        Any,
        _doc(
            "{'type': 'enabled', 'budget_tokens'} | {'type': 'disabled'} | {'type': "
            "'adaptive'}: with --reasoning-parser, the thinking is a thinking block; "
            "disabled turns the template's thinking off.",
            type="object",
            required=["type"],
            examples=[{"type": "disabled"}],
        ),
    ] = None


class MessagesBody(CountTokensBody, kw_only=True):
    """What `/v1/messages` reads."""

    max_tokens: Annotated[
        Annotated[int, Meta(ge=0)] | None, _doc("Required: the most tokens to generate.")
    ] = None
    stop_sequences: Annotated[
        list[str] | None, _doc("Strings that end the output (not included in it).")
    ] = None
    temperature: Annotated[float | None, _doc("Sampling temperature; 0 is greedy.")] = None
    top_p: Annotated[float | None, _doc("Nucleus sampling.")] = None
    top_k: Annotated[int | None, _doc("Sample from the k likeliest tokens.")] = None
    stream: Annotated[bool | None, _doc("Answer with Anthropic's server-sent events.")] = None
    metadata: Annotated[dict[str, Any] | None, _doc(_IGNORED)] = None


#: Both request bodies and the message, for /openapi.json, by component name.
SCHEMAS: dict[str, type[msgspec.Struct]] = {
    "AnthropicMessagesRequest": MessagesBody,
    "AnthropicCountTokensRequest": CountTokensBody,
    "AnthropicMessage": AnthropicMessage,
    "AnthropicTool": AnthropicTool,
}
