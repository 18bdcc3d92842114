"""The errors both APIs raise beyond the engine's own, and how an engine finish reason
carries a status. Each API renders them in its own shape (`sglang/errors.py`,
`openai/errors.py`); statuses come from the errors themselves (`error.http_status`).

The hierarchy (engine errors keep their statuses; these add what the HTTP side needs)::

    engine.EngineError                     status from the engine (400, 503, 500)
    ├── engine.BadRequest                  400
    │   └── InvalidRequest                 400  a body is wrong; knows the offending `param`
    ├── Unauthorized                       401  wrong or missing API key (when one is configured)
    └── StatusError                        any  a status decided elsewhere: a scheduler abort
                                                with a status code, Quart's 405/413

`limits.py` adds `RequestTooLarge` (413) and `RequestTimedOut` (408).

`install_error_handlers` makes every failure of a view an error body in one API's shape:

    install_error_handlers(bp, openai_error_response, logger=LOGGER)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from quart import Blueprint, Quart, Response, request
from werkzeug.exceptions import HTTPException

from tributary.engine import BadRequest, EngineError, FinishReason

__all__ = [
    "InvalidRequest",
    "StatusError",
    "Unauthorized",
    "abort_status",
    "install_error_handlers",
]

#: How one API writes an error body (with the error's status) for an `EngineError`.
Render = Callable[[EngineError], Response]


class InvalidRequest(BadRequest):
    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Unauthorized(EngineError):
    http_status = 401
    err_type = "authentication_error"

    def __init__(self, message: str = "Incorrect API key provided.") -> None:
        super().__init__(message)


class StatusError(EngineError):
    """An error whose status was decided elsewhere: a `Done` whose abort finish_reason carries
    a status code (a scheduler rejection), or an HTTP error Quart raised (405, 413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.http_status = status


def abort_status(finish_reason: FinishReason) -> tuple[int, str] | None:
    """(status, message) when `finish_reason` is an abort carrying a status code, else None."""
    if finish_reason.get("type") != "abort":
        return None
    code = finish_reason.get("status_code")
    if code is None:
        return None
    return int(code), finish_reason.get("message") or "request aborted"


def install_error_handlers(
    target: Quart | Blueprint,
    render: Render,
    *,
    logger: logging.Logger,
    render_unexpected: Render | None = None,
    where: str | None = None,
) -> None:
    """Answer every error raised under `target` (an app, or a blueprint's views) with
    `render`: an `EngineError` as it is, an HTTP error Quart raised (404, 405, 413) as a
    `StatusError` with its status, and any other exception, logged with its traceback, as a
    500 `StatusError` naming only its type (`render_unexpected` renders it, if given). The
    log line says "unhandled error in " and `where`, or the request's method and path."""
    unexpected = render_unexpected or render

    async def on_engine_error(error: EngineError) -> Response:
        return render(error)

    async def on_http_error(error: HTTPException) -> Response:
        return render(StatusError(error.code or 500, error.description or error.name))

    async def on_unexpected(error: Exception) -> Response:
        if where is not None:
            logger.exception("unhandled error in %s", where, exc_info=error)
        else:
            logger.exception(
                "unhandled error in %s %s", request.method, request.path, exc_info=error
            )
        return unexpected(StatusError(500, f"Internal server error: {type(error).__name__}"))

    target.register_error_handler(EngineError, on_engine_error)
    target.register_error_handler(HTTPException, on_http_error)
    target.register_error_handler(Exception, on_unexpected)
