"""Chat `messages` as the chat template sees them.

Synopsis::

    parse_messages([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    # -> [{"role": "user", "content": "Hi"}]

Roles are `system`, `user` and `assistant`; `content` is a string or a list of text parts;
`name` is kept. Tool calls, tool and function roles, and non-text parts (images, audio) are
refused with `InvalidRequest` naming the offending field, never dropped.
"""

from __future__ import annotations

from typing import Any

from .errors import InvalidRequest

__all__ = ["CHAT_ROLES", "MAX_MESSAGES", "parse_messages"]

CHAT_ROLES = ("system", "developer", "user", "assistant")

#: The most messages one chat may hold (OpenAI's and Azure OpenAI's limit; SGLang, vLLM and
#: llama-server set none). Refused before any is read or templated: rendering and tokenizing
#: cost grows with the count (docs/reliability.md, "Special tokens and long chats").
MAX_MESSAGES = 2048


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
    out = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object.", param=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"{where}.role must be one of {', '.join(map(repr, CHAT_ROLES))}, got {role!r}.",
                param=f"{where}.role",
            )
        for key in ("tool_calls", "function_call"):
            if message.get(key) not in (None, [], {}):
                raise InvalidRequest(
                    f"{where}.{key} is not supported by this server yet.", param=f"{where}.{key}"
                )
        # OpenAI's newer name for the system role; chat templates know only "system".
        role = "system" if role == "developer" else role
        entry = {"role": role, "content": _content(message.get("content"), where)}
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequest(f"{where}.name must be a string.", param=f"{where}.name")
            entry["name"] = name
        out.append(entry)
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(
                    f"{where}.content[{j}] must be a text part "
                    f'{{"type": "text", "text": ...}}; got type {kind!r} (only text is '
                    "supported).",
                    param=f"{where}.content",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequest(
        f"{where}.content must be a string or a list of text parts, got {content!r}.",
        param=f"{where}.content",
    )
