"""Anthropic-shaped errors for `/v1/messages`: the wire shape, and the one failure only this API
adds.

The hierarchy is the engine's and `http.errors`' (statuses come from the errors themselves);
this adds::

    engine.EngineError
    ├── ModelNotFound                      404  `model` names a model this server does not serve
    └── Aborted                            500  `/abort_request` ended the message

Body shape, as Anthropic sends it (the `anthropic` client raises `BadRequestError`,
`NotFoundError`, ... by status and reads `error.type`)::

    {"type": "error", "error": {"type": str, "message": str}}

`error.type` is Anthropic's name for the status: `invalid_request_error` (400 and other 4xx),
`authentication_error` (401), `permission_error` (403), `not_found_error` (404),
`timeout_error` (408, 504), `request_too_large` (413), `rate_limit_error` (429), `api_error`
(500, 501), `overloaded_error` (503: a full queue, with `Retry-After`, or a draining server).
After a stream has started, the same object is an `event: error` server-sent event, and the
stream ends there. `Aborted`'s response carries `x-should-retry: false`: Anthropic's (and
OpenAI's) clients retry a 500 unless that header says not to, which would run the aborted
message again.
"""

from __future__ import annotations

from typing import Any

from quart import Response

from tributary.engine import EngineError, QueueFull

from ..http.responses import json_response

__all__ = ["Aborted", "ModelNotFound", "anthropic_error_object", "anthropic_error_response"]

_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class ModelNotFound(EngineError):
    http_status = 404
    err_type = "not_found_error"

    def __init__(self, model: str, served: str) -> None:
        super().__init__(
            f"model: the model `{model}` does not exist; this server serves `{served}`."
        )


class Aborted(EngineError):
    """An operator's `/abort_request` (no stop reason says so): not the client's fault, and
    not worth retrying."""

    http_status = 500
    err_type = "api_error"


def _type_for(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_object(error: EngineError) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": _type_for(error.http_status), "message": error.message},
    }


def anthropic_error_response(error: EngineError) -> Response:
    headers = {"Retry-After": str(error.retry_after)} if isinstance(error, QueueFull) else None
    if isinstance(error, Aborted):
        headers = {"x-should-retry": "false"}
    return json_response(anthropic_error_object(error), status=error.http_status, headers=headers)
