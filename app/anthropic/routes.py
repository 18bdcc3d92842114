"""`anthropic_blueprint`: Anthropic's Messages API and how its errors become Anthropic error
bodies.

Routes: `POST /v1/messages`, `POST /v1/messages/count_tokens`.

Every error raised by these views (engine errors, Quart's HTTP errors, and unexpected
exceptions as a logged 500) is answered in Anthropic's shape (`errors.py`). When the server
has an API key, Anthropic's clients send it as `x-api-key`; the app's hook takes that header
beside `Authorization: Bearer` on every route (`app/http/auth.py`), as llama-server does.
"""

from __future__ import annotations

import logging

from quart import Blueprint, Response

from tributary.engine import Capabilities, EngineService

from ..http.body import read_json_body
from ..http.errors import install_error_handlers
from ..http.view import ViewRequest
from ..settings import ServerSettings
from .errors import anthropic_error_response
from .messages import count_message_tokens, create_message
from .served import ServedChat

__all__ = ["MESSAGES_PATH", "anthropic_blueprint"]

LOGGER = logging.getLogger("tributary.anthropic")

#: The generation route; it and the paths under it are this API's (the app's hook and error
#: handlers recognise them by path).
MESSAGES_PATH = "/v1/messages"


def anthropic_blueprint(
    engine: EngineService,
    settings: ServerSettings | None = None,
    capabilities: Capabilities | None = None,
) -> Blueprint:
    """Anthropic's Messages API for `engine`; register it on the app serving that engine.
    `capabilities`: the engine's, when the app already asked (`ServerState`)."""
    http = settings or ServerSettings()
    served = ServedChat.for_engine(engine, http, capabilities)
    bp = Blueprint("anthropic", __name__, url_prefix="/v1")

    @bp.route("/messages", methods=["POST"])
    async def messages() -> Response:
        return await create_message(served, await ViewRequest.read(http))

    @bp.route("/messages/count_tokens", methods=["POST"])
    async def count_tokens() -> Response:
        return await count_message_tokens(served, await read_json_body())

    install_error_handlers(bp, anthropic_error_response, logger=LOGGER)
    return bp
