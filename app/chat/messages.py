"""Chat `messages` as the chat template sees them.

Synopsis::

    parse_messages([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    # -> [{"role": "user", "content": "Hi"}]

Roles are `system` (and OpenAI's `developer`), `user`, `assistant` and `tool`; `content` is a
string or a list of text parts; `name` is kept. An assistant message may carry `tool_calls`
(its content may then be null or left out) and `reasoning_content`; a `tool` message needs the
`tool_call_id` it answers. They reach the template as Hugging Face templates expect them (as
SGLang passes them): a call's `function.arguments` parsed from its JSON string into an object,
a null content as "". `function_call`, the `function` role and non-text parts (images, audio)
are refused with `InvalidRequest` naming the offending field, never dropped.

A message's fields are declared once, in `ChatMessage` (its schema is /openapi.json's
`ChatMessage`); the messages are converted through it in one call. When one does not convert,
each is converted field by field in the order of the checks (`_ORDER`): a field not of its
declared type gets its 400 from `_fault`, the role and refused fields theirs from `_check`,
so the first problem is the one reported.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from tributary.engine.wire import convert

from ..http.errors import InvalidRequest

__all__ = [
    "CHAT_ROLES",
    "MAX_MESSAGES",
    "ChatMessage",
    "MessageToolCall",
    "TextPart",
    "message_list",
    "parse_messages",
    "template_tool_call",
]

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

#: The most messages one chat may hold (OpenAI's and Azure OpenAI's limit; SGLang, vLLM and
#: llama-server set none). Refused before any is read or templated: rendering and tokenizing
#: cost grows with the count (docs/reliability.md, "Special tokens and long chats").
MAX_MESSAGES = 2048

_REFUSED = "Not supported by this server yet: a 400 when set."


class TextPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]
    text: str


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: Annotated[
        str | dict[str, Any], Meta(description="The arguments: a JSON object, as a string.")
    ]


class MessageToolCall(msgspec.Struct, kw_only=True):
    """A call an earlier assistant turn made."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(msgspec.Struct, kw_only=True):
    """One chat message; `developer` is OpenAI's newer name for `system`."""

    role: Annotated[str, Meta(extra_json_schema={"enum": list(CHAT_ROLES)})]
    # Declared required so that the usual message converts in one call; a message without
    # it (an assistant's with tool_calls) converts field by field, as a null.
    content: Annotated[
        str | list[TextPart] | None,
        Meta(
            description="A string, or text parts (joined with newlines). May be null or left "
            "out only in an assistant message."
        ),
    ]
    name: str | None = None
    tool_calls: Annotated[
        list[MessageToolCall] | None, Meta(description="Assistant messages: the calls made.")
    ] = None
    tool_call_id: Annotated[
        str | None, Meta(description="Tool messages (required): the call this answers.")
    ] = None
    reasoning_content: Annotated[
        str | None, Meta(description="Assistant messages: the turn's reasoning, for templates.")
    ] = None
    function_call: Annotated[Any, Meta(description=_REFUSED)] = None


_MESSAGES = list[ChatMessage]
#: The order a message's faults are reported in (the checks of parse_messages' loop).
_ORDER = ("role", "function_call", "tool_calls", "content", "name", "tool_call_id")
_REFUSABLE = ("function_call",)
_CALL_SHAPE = '{"id", "type": "function", "function": {"name", "arguments"}}'


def parse_messages(raw: Any) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: role, content as one string, optional name,
    tool calls and tool call id.

    Text parts of a list content are joined with newlines, as vLLM does for templates that
    expect string content.
    """
    raw = message_list(raw)
    try:
        declared: list[ChatMessage] | None = msgspec.convert(raw, _MESSAGES)
    except msgspec.ValidationError:
        declared = None  # one by one, below, for the first fault's words
    out = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if declared is not None:
            fields = declared[i]
        elif not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object.", param=where)
        else:
            fields = convert(
                message,
                ChatMessage,
                fault=partial(_fault, where),
                order=_ORDER,
                check=partial(_check, where),
            )
        for key in ("role", *_REFUSABLE):
            _check(where, key, getattr(fields, key))
        # OpenAI's newer name for the system role; chat templates know only "system".
        role = "system" if fields.role == "developer" else fields.role
        content = fields.content
        if content is None:
            if role != "assistant":
                raise InvalidRequest(
                    f"{where}.content is required in a {role} message.", param=f"{where}.content"
                )
            content = ""  # SGLang's: templates expect a string
        elif not isinstance(content, str):  # text parts
            content = "\n".join(part.text for part in content)
        entry: dict[str, Any] = {"role": role, "content": content}
        if fields.name is not None:
            entry["name"] = fields.name
        if fields.tool_calls or fields.tool_call_id is not None or role == "tool":
            _tool_fields(where, role, fields, entry)
        if fields.reasoning_content is not None:
            entry["reasoning_content"] = fields.reasoning_content
        out.append(entry)
    return out


def message_list(raw: Any, *, within: str = "chat") -> list[Any]:
    """`raw` when it is a list of 1 to `MAX_MESSAGES` entries (any API's `messages`), else
    the 400 saying what is wrong, before any message is read."""
    if raw is None:
        raise InvalidRequest("messages is required.", param="messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages must be a non-empty list of messages.", param="messages")
    if len(raw) > MAX_MESSAGES:
        raise InvalidRequest(
            f"messages holds {len(raw)} messages; this server takes at most {MAX_MESSAGES} "
            f"in one {within}.",
            param="messages",
        )
    return raw


def template_tool_call(call_id: str | None, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A call of an earlier turn as Hugging Face templates read it (`arguments` an object)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_fields(where: str, role: str, fields: ChatMessage, entry: dict[str, Any]) -> None:
    """A message's `tool_calls` (assistant) or `tool_call_id` (tool), checked into `entry`."""
    if fields.tool_calls:
        if role != "assistant":
            raise InvalidRequest(
                f"{where}.tool_calls is only allowed in assistant messages.",
                param=f"{where}.tool_calls",
            )
        calls = []
        for j, call in enumerate(fields.tool_calls):
            arguments = call.function.arguments
            if isinstance(arguments, str):
                arguments = _arguments(f"{where}.tool_calls[{j}].function.arguments", arguments)
            calls.append(template_tool_call(call.id, call.function.name, arguments))
        entry["tool_calls"] = calls
    if role == "tool":
        if fields.tool_call_id is None:
            raise InvalidRequest(
                f"{where}.tool_call_id is required in a tool message: the id of the call it "
                "answers.",
                param=f"{where}.tool_call_id",
            )
        entry["tool_call_id"] = fields.tool_call_id
    elif fields.tool_call_id is not None:
        raise InvalidRequest(
            f"{where}.tool_call_id is only allowed in tool messages.",
            param=f"{where}.tool_call_id",
        )


def _arguments(where: str, text: str) -> dict[str, Any]:
    """SGLang's rule (`parse_tool_call_arguments`), in its words: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        raise InvalidRequest(
            f"Assistant tool call function.arguments must be valid JSON ({where}).", param=where
        ) from None
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"Assistant tool call function.arguments must be a JSON object ({where}).",
            param=where,
        )
    return value


def _check(where: str, key: str, value: Any) -> None:
    """A message's rules beyond its declared types: a known role, nothing refused."""
    if key == "role" and value not in CHAT_ROLES:
        raise InvalidRequest(
            f"{where}.role must be one of {', '.join(map(repr, CHAT_ROLES))}, got {value!r}.",
            param=f"{where}.role",
        )
    if key in _REFUSABLE and value not in (None, [], {}):
        raise InvalidRequest(
            f"{where}.{key} is not supported by this server yet.", param=f"{where}.{key}"
        )


def _fault(where: str, key: str, value: Any) -> Any:
    """The 400 for a message field that is not of its declared type (a missing one is a
    null)."""
    if key == "role":
        _check(where, key, value)  # not a string: not a role either
    if key in ("name", "tool_call_id", "reasoning_content"):
        raise InvalidRequest(f"{where}.{key} must be a string.", param=f"{where}.{key}")
    if key == "tool_calls":
        _call_fault(where, value)
    if key == "content" and isinstance(value, list):
        for j, part in enumerate(value):
            try:
                msgspec.convert(part, TextPart)
            except msgspec.ValidationError:
                kind = part.get("type") if isinstance(part, dict) else None
                raise InvalidRequest(
                    f"{where}.content[{j}] must be a text part "
                    f'{{"type": "text", "text": ...}}; got type {kind!r} (only text is '
                    "supported).",
                    param=f"{where}.content",
                ) from None
    if key == "content":
        raise InvalidRequest(
            f"{where}.content must be a string or a list of text parts, got {value!r}.",
            param=f"{where}.content",
        )
    raise AssertionError(f"no fault message for {key}")  # only these fields can fault


def _call_fault(where: str, value: Any) -> None:
    """The 400 for `tool_calls` that is not a list of OpenAI's call objects: the first entry
    (and field) that is not."""
    if not isinstance(value, list):
        raise InvalidRequest(
            f"{where}.tool_calls must be a list of {_CALL_SHAPE} objects, got {value!r}.",
            param=f"{where}.tool_calls",
        )
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        try:
            msgspec.convert(call, MessageToolCall)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(
                f"{at} must be {_CALL_SHAPE} (function.arguments a JSON string): {exc}.",
                param=at,
            ) from None
    raise AssertionError("tool_calls converted one by one but not whole")
