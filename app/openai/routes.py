"""`openai_blueprint`: the `/v1` routes and how their errors become OpenAI error bodies.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/embeddings`,
`GET /v1/models`, `GET /v1/models/{id}` (404 for any id but the served model's).

Every error raised by a `/v1` view (engine errors, this package's errors, Quart's HTTP
errors, and unexpected exceptions as a logged 500) is answered in OpenAI's shape
(`errors.py`). When the settings carry an `api_key`, `/v1` requests must send
`Authorization: Bearer <key>`, else 401.
"""

from __future__ import annotations

import logging

from quart import Blueprint, Response

from tributary.engine import Capabilities, EngineService

from ..http.errors import install_error_handlers
from ..http.responses import json_response
from ..http.view import ViewRequest
from ..settings import ServerSettings
from .chat import create_chat_completion
from .completions import create_completion
from .embeddings import create_embedding
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
    served = ServedModel.for_engine(engine, http, capabilities)
    embedder = (capabilities or Capabilities.of(engine)).embeddings
    bp = Blueprint("openai", __name__, url_prefix="/v1")

    @bp.route("/completions", methods=["POST"])
    async def completions() -> Response:
        return await create_completion(served, await ViewRequest.read(http))

    @bp.route("/chat/completions", methods=["POST"])
    async def chat_completions() -> Response:
        return await create_chat_completion(served, await ViewRequest.read(http))

    @bp.route("/embeddings", methods=["POST"])
    async def embeddings() -> Response:
        call = await ViewRequest.read(http)
        return await create_embedding(
            served,
            call.body,
            call.owned,
            call.exchange,
            deadline=call.deadline,
            embeddings=embedder,
        )

    @bp.route("/models", methods=["GET"])
    async def models() -> Response:
        return json_response({"object": "list", "data": [served.card()]})

    @bp.route("/models/<path:model_id>", methods=["GET"])
    async def model(model_id: str) -> Response:
        served.check_model(model_id)
        return json_response(served.card())

    install_error_handlers(bp, openai_error_response, logger=LOGGER)
    return bp
