"""What `/openapi.json` says of Anthropic's routes: their operations, the response schemas and
what the request declarations leave to the rules (app/openapi.py merges them in; the request
schemas come from models.py's Structs).

Synopsis::

    paths = anthropic_paths(errors, timeout_header)    # {"/v1/messages": {...}, ...}
    RESPONSES["AnthropicReply"], REQUIRED["AnthropicMessagesRequest"]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["REQUIRED", "RESPONSES", "anthropic_paths"]

Schema = dict[str, Any]

_STR: Schema = {"type": "string"}
_COUNT: Schema = {"type": "integer", "minimum": 0}
#: The statuses these routes answer besides 200 (`errors.py` names their types).
_ERRORS = (400, 401, 404, 408, 413, 500, 501, 503)

_ERROR: Schema = {
    "type": "object",
    "description": "Anthropic's error body (/v1/messages).",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": _STR, "message": _STR},
        },
    },
}

_BLOCK: Schema = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": _STR},
        },
        {
            "type": "object",
            "required": ["type", "thinking", "signature"],
            "properties": {"type": {"const": "thinking"}, "thinking": _STR, "signature": _STR},
        },
        {
            "type": "object",
            "required": ["type", "id", "name", "input"],
            "properties": {
                "type": {"const": "tool_use"},
                "id": _STR,
                "name": _STR,
                "input": {"type": "object"},
            },
        },
    ]
}

_REPLY: Schema = {
    "type": "object",
    "description": "Anthropic's Message.",
    "required": ["id", "type", "role", "content", "model", "stop_reason", "stop_sequence", "usage"],
    "properties": {
        "id": _STR,
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "content": {"type": "array", "items": _BLOCK},
        "model": _STR,
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": {"anyOf": [_STR, {"type": "null"}]},
        "usage": {
            "type": "object",
            "required": ["input_tokens", "output_tokens"],
            "properties": {
                "input_tokens": _COUNT,
                "cache_read_input_tokens": _COUNT,
                "output_tokens": _COUNT,
            },
        },
    },
}

_TOKEN_COUNT: Schema = {
    "type": "object",
    "required": ["input_tokens"],
    "properties": {"input_tokens": _COUNT},
}

#: Response schemas, by component name.
RESPONSES: dict[str, Schema] = {"AnthropicError": _ERROR, "AnthropicReply": _REPLY}

#: What the declarations leave to the rules (a missing field is worded there), for the reader.
REQUIRED: dict[str, Schema] = {
    "AnthropicMessagesRequest": {"required": ["messages", "max_tokens"]},
    "AnthropicCountTokensRequest": {"required": ["messages"]},
}


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def anthropic_paths(
    errors: Callable[..., dict[str, Any]], timeout_header: dict[str, Any]
) -> dict[str, Any]:
    """The two operations; `errors(component, *statuses)` writes the error responses."""

    def operation(summary: str, request: str, answer: Schema, **extra: Any) -> dict[str, Any]:
        return {
            "summary": summary,
            **extra,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {"200": answer, **errors("AnthropicError", *_ERRORS)},
        }

    message = {
        "description": "A message, or with `stream`, Anthropic's server-sent events.",
        "content": {
            "application/json": {"schema": _ref("AnthropicReply")},
            "text/event-stream": {"schema": _STR},
        },
    }
    count = {
        "description": "The prompt's tokens.",
        "content": {"application/json": {"schema": _TOKEN_COUNT}},
    }
    return {
        "/v1/messages": {
            "post": operation(
                "Anthropic's Messages API",
                "AnthropicMessagesRequest",
                message,
                parameters=[timeout_header],
            )
        },
        "/v1/messages/count_tokens": {
            "post": operation(
                "The prompt's size, as /v1/messages would run it",
                "AnthropicCountTokensRequest",
                count,
            )
        },
    }
