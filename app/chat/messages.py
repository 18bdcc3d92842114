"""Chat `messages` as the chat template sees them.

Synopsis::

    parse_messages([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    # -> [{"role": "user", "content": "Hi"}]

Roles are `system`, `user` and `assistant`; `content` is a string or a list of text parts;
`name` is kept. Tool calls, tool and function roles, and non-text parts (images, audio) are
refused with `InvalidRequest` naming the offending field, never dropped.

A message's fields are declared once, in `ChatMessage` (its schema is /openapi.json's
`ChatMessage`); the messages are converted through it in one call. When one does not convert,
each is converted field by field in the order of the checks (`_ORDER`): a field not of its
declared type gets its 400 from `_fault`, the role and refused fields theirs from `_check`,
so the first problem is the one reported.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from tributary.engine.wire import convert

from ..http.errors import InvalidRequest

__all__ = ["CHAT_ROLES", "MAX_MESSAGES", "ChatMessage", "TextPart", "parse_messages"]

CHAT_ROLES = ("system", "developer", "user", "assistant")

#: The most messages one chat may hold (OpenAI's and Azure OpenAI's limit; SGLang, vLLM and
#: llama-server set none). Refused before any is read or templated: rendering and tokenizing
#: cost grows with the count (docs/reliability.md, "Special tokens and long chats").
MAX_MESSAGES = 2048

_REFUSED = "Not supported by this server yet: a 400 when set."


class TextPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, kw_only=True):
    """One chat message; `developer` is OpenAI's newer name for `system`."""

    role: Annotated[str, Meta(extra_json_schema={"enum": list(CHAT_ROLES)})]
    content: Annotated[
        str | list[TextPart],
        Meta(description="A string, or text parts (joined with newlines)."),
    ]
    name: str | None = None
    tool_calls: Annotated[Any, Meta(description=_REFUSED)] = None
    function_call: Annotated[Any, Meta(description=_REFUSED)] = None


_MESSAGES = list[ChatMessage]
#: The order a message's faults are reported in (the checks of parse_messages' loop).
_ORDER = ("role", "tool_calls", "function_call", "content", "name")
_REFUSABLE = ("tool_calls", "function_call")


def parse_messages(raw: Any) -> list[dict[str, str]]:
    """Messages as the chat template sees them: role, content as one string, optional name.

    Text parts of a list content are joined with newlines, as vLLM does for templates that
    expect string content.
    """
    if raw is None:
        raise InvalidRequest("messages is required.", param="messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages must be a non-empty list of messages.", param="messages")
    if len(raw) > MAX_MESSAGES:
        raise InvalidRequest(
            f"messages holds {len(raw)} messages; this server takes at most {MAX_MESSAGES} "
            "in one chat.",
            param="messages",
        )
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
        if not isinstance(content, str):  # text parts
            content = "\n".join(part.text for part in content)
        entry = {"role": role, "content": content}
        if fields.name is not None:
            entry["name"] = fields.name
        out.append(entry)
    return out


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
    if key == "name":
        raise InvalidRequest(f"{where}.name must be a string.", param=f"{where}.name")
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
    raise AssertionError(f"no fault message for {key}")  # only these three can fault
