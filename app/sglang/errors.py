"""How failures look on the wire. Statuses come from `engine.errors` (`error.http_status`);
this module only shapes them.

- HTTP error body (before the first byte of a response): `{"error": {"message", "code"}}`,
  with the real status. A full queue is the exception: SGLang raises it as an HTTPException,
  whose handler answers its OpenAI-layer object (`sglang_error_object`) with the status as
  `type`, `{"object": "error", "message", "type": "503", "param": null, "code": 503}`, and we
  add `Retry-After`. (A stream that cannot be queued is a 200 with an abort frame instead:
  `sse.refused_stream_response`.)
- Stream error item (after streaming started): the same object, plus `index` in a batch,
  followed eventually by `data: [DONE]`.
- Batch item failure (unary batch): the same object as that item's array entry; HTTP 200.
- A `Done` whose finish_reason is `{"type": "abort", "status_code": N, ...}` with N not null is
  a failure with status N (a scheduler-side rejection); an abort without a status code (client
  abort, `/abort_request`) is an ordinary completion.
"""

from __future__ import annotations

from typing import Any

from quart import Response

from tributary.engine import EngineError, QueueFull

from ..http.responses import json_response

__all__ = [
    "engine_error_response",
    "error_object",
    "error_response",
    "sglang_error_object",
]


def error_object(message: str, code: int, *, index: int | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {"error": {"message": message, "code": code}}
    if index is not None:
        obj["index"] = index
    return obj


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return json_response(error_object(message, status), status=status, headers=headers)


def sglang_error_object(
    message: str, code: int, *, err_type: str, param: str | None = None
) -> dict[str, Any]:
    """SGLang's `ErrorResponse`: the body of its OpenAI layer (`/v1`, `/tokenize`) and of its
    HTTPException handler, which `/generate` reaches on a full queue."""
    return {"object": "error", "message": message, "type": err_type, "param": param, "code": code}


def engine_error_response(error: EngineError) -> Response:
    if isinstance(error, QueueFull):
        status = error.http_status
        return json_response(
            sglang_error_object(error.message, status, err_type=str(status)),
            status=status,
            headers={"Retry-After": str(error.retry_after)},
        )
    return error_response(error.http_status, error.message)
