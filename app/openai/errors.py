"""OpenAI-shaped errors for `/v1`: the few failures only this API has, and the wire shape.

The hierarchy (engine errors keep their statuses; `http.errors` adds `InvalidRequest`,
`Unauthorized` and `StatusError`; these add what the OpenAI API needs)::

    engine.EngineError                     status from the engine (400, 503, 500)
    ├── engine.BadRequest                  400
    │   └── http.errors.InvalidRequest     400  a body is wrong; knows the offending `param`
    │       └── chat.served.NoChatTemplate 400  the model has no chat template
    └── ModelNotFound                      404  `model` names a model this server does not serve

Body shape, as OpenAI sends it (`openai` turns it into `APIStatusError` subclasses by status)::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

`type` is OpenAI's family name for the status (`invalid_request_error` for 400, 404 and 413,
`authentication_error` for 401, `timeout_error` for 408, `server_error` for 5xx); `code` is
OpenAI's machine-readable code where one exists (`model_not_found`, `context_length_exceeded`,
`invalid_api_key`), else null. Errors after a stream has started are the same object as an
SSE event, then `[DONE]`.
"""

from __future__ import annotations

from typing import Any

from quart import Response

from tributary.engine import ContextLengthExceeded, EngineError, QueueFull

from ..http.errors import Unauthorized
from ..http.responses import json_response

__all__ = [
    "ModelNotFound",
    "openai_error_object",
    "openai_error_response",
]


class ModelNotFound(EngineError):
    http_status = 404
    err_type = "invalid_request_error"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")
        self.param = "model"


def _type_for(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 408:
        return "timeout_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def _code_for(error: EngineError) -> str | None:
    if isinstance(error, ModelNotFound):
        return "model_not_found"
    if isinstance(error, ContextLengthExceeded):
        return "context_length_exceeded"
    if isinstance(error, Unauthorized):
        return "invalid_api_key"
    return None


def openai_error_object(error: EngineError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": _type_for(error.http_status),
            "param": getattr(error, "param", None),
            "code": _code_for(error),
        }
    }


def openai_error_response(error: EngineError) -> Response:
    headers = {"Retry-After": str(error.retry_after)} if isinstance(error, QueueFull) else None
    return json_response(openai_error_object(error), status=error.http_status, headers=headers)
