"""`openai_blueprint`: the `/v1` routes and how their errors become OpenAI error bodies.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
`GET /v1/models/{id}` (404 for any id but the served model's).

Every error raised by a `/v1` view (engine errors, this package's errors, Quart's HTTP
errors, and unexpected exceptions as a logged 500) is answered in OpenAI's shape
(`errors.py`). When the settings carry an `api_key`, `/v1` requests must send
`Authorization: Bearer <key>`, else 401.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from quart import Blueprint, Response, request
from werkzeug.exceptions import HTTPException

from tributary.engine import EngineError, EngineService

from ..asgi import owned_by_request
from ..exchange import exchange_of
from ..normalize import read_within_deadline
from ..output import json_response
from ..settings import ServerSettings
from .chat import create_chat_completion
from .completions import create_completion
from .errors import StatusError, openai_error_response
from .served import ServedModel

__all__ = ["openai_blueprint"]

LOGGER = logging.getLogger("tributary.openai")


def openai_blueprint(engine: EngineService, settings: ServerSettings | None = None) -> Blueprint:
    """The OpenAI-compatible API for `engine`; register it on the app serving that engine."""
    http = settings or ServerSettings()
    served = ServedModel.for_engine(
        engine, timing_detail=http.enable_request_timing, max_logprobs=http.max_logprobs
    )
    bp = Blueprint("openai", __name__, url_prefix="/v1")

    async def answer(create: Callable[..., Awaitable[Response]]) -> Response:
        body, deadline = await read_within_deadline(http)
        scope = request.scope
        return await create(
            served, body, owned_by_request(scope), exchange_of(scope), deadline=deadline
        )

    @bp.route("/completions", methods=["POST"])
    async def completions() -> Response:
        return await answer(create_completion)

    @bp.route("/chat/completions", methods=["POST"])
    async def chat_completions() -> Response:
        return await answer(create_chat_completion)

    @bp.route("/models", methods=["GET"])
    async def models() -> Response:
        return json_response({"object": "list", "data": [served.card()]})

    @bp.route("/models/<path:model_id>", methods=["GET"])
    async def model(model_id: str) -> Response:
        served.check_model(model_id)
        return json_response(served.card())

    @bp.errorhandler(EngineError)
    async def on_engine_error(error: EngineError) -> Response:
        return openai_error_response(error)

    @bp.errorhandler(HTTPException)
    async def on_http_error(error: HTTPException) -> Response:
        code = error.code or 500
        return openai_error_response(StatusError(code, error.description or error.name))

    @bp.errorhandler(Exception)
    async def on_unexpected(error: Exception) -> Response:
        LOGGER.exception("unhandled error in %s %s", request.method, request.path, exc_info=error)
        return openai_error_response(
            StatusError(500, f"Internal server error: {type(error).__name__}")
        )

    return bp
