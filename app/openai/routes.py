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

from tributary.engine import Capabilities, EngineService

from ..http.asgi import owned_by_request
from ..http.body import read_within_deadline
from ..http.errors import install_error_handlers
from ..http.responses import json_response
from ..observe.exchange import exchange_of
from ..settings import ServerSettings
from .chat import create_chat_completion
from .completions import create_completion
from .errors import openai_error_response
from .served import ServedModel

__all__ = ["openai_blueprint"]

LOGGER = logging.getLogger("tributary.openai")


def openai_blueprint(
    engine: EngineService,
    settings: ServerSettings | None = None,
    capabilities: Capabilities | None = None,
) -> Blueprint:
    """The OpenAI-compatible API for `engine`; register it on the app serving that engine.
    `capabilities`: the engine's, when the app already asked (`ServerState`)."""
    http = settings or ServerSettings()
    served = ServedModel.for_engine(
        engine,
        capabilities,
        timing_detail=http.enable_request_timing,
        max_logprobs=http.max_logprobs,
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

    install_error_handlers(bp, openai_error_response, logger=LOGGER)
    return bp
