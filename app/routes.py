"""`create_app`: the Quart-Trio application, its routes, and how errors become responses.

Synopsis::

    app = create_app(eng, ServerSettings(port=0))
    async with open_http_server(app, settings) as urls: ...     # or app.test_client()

Routes (docs/api.md has the wire details): SGLang's native API (`/generate` and the endpoints
around it) in `sglang/`; OpenAI's `/v1` in `openai/`; Anthropic's `/v1/messages` in `anthropic/`;
`/openapi.json`, describing them all, in `openapi.py`.

Error handling: a handler raises `engine.EngineError` (or a subclass) for anything wrong with
a request; one error handler turns it into `{"error": {"message", "code"}}` with the error's
status. Quart's own HTTP errors (404, 405, 413) get the same shape, and an unexpected
exception is logged and answered with a 500 in that shape, so every error a client sees is
JSON it can parse.
"""

from __future__ import annotations

import logging

from quart import Response, request
from quart_trio import QuartTrio

from tributary.engine import EngineClosed, EngineError, EngineService

from .anthropic import (
    MESSAGES_PATH,
    anthropic_blueprint,
    anthropic_error_response,
)
from .http.asgi import (
    CloseOwned,
    RefuseAmbiguousLength,
    RefuseWebSockets,
    ShieldFinalSend,
)
from .http.auth import bearer_is, x_api_key_is
from .http.direct_send import DirectSend
from .http.errors import Unauthorized, install_error_handlers
from .observe.exchange import GENERATION_PATHS, ObserveExchanges, exchange_of
from .observe.metrics import Metrics
from .openai import openai_blueprint
from .openai.errors import openai_error_response
from .openapi import openapi_blueprint
from .settings import ServerSettings
from .sglang import add_sglang_routes
from .sglang.admin import ADMIN_PATHS, version
from .sglang.errors import engine_error_response
from .state import ServerState

__all__ = ["create_app"]

LOGGER = logging.getLogger("tributary.app")


def create_app(engine: EngineService, settings: ServerSettings | None = None) -> QuartTrio:
    """Build the app for `engine`. The caller keeps the engine open while the app serves."""
    settings = settings or ServerSettings()
    # No static folder: every route is an API route that /openapi.json describes.
    app = QuartTrio("tributary", static_folder=None)
    # Streams disable the timeout per response too; unary generations can be long as well.
    app.config["RESPONSE_TIMEOUT"] = None
    # Checked as the body arrives, before it is buffered whole (http/limits.py).
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    state = ServerState(engine, settings)
    if settings.enable_metrics:
        model_name = engine.config.served_model_name or engine.model_info.name
        state.metrics = Metrics(engine, model_name=model_name, fleet=state.capabilities.fleet)
    state.attach(app)
    # Outermost, DirectSend makes Hypercorn's socket writes skip its lock and send_all when
    # the socket takes them at once (app/http/direct_send.py). WebSocket upgrades and requests
    # with both Content-Length and Transfer-Encoding are refused before Quart (http/asgi.py).
    app.asgi_app = DirectSend(  # type: ignore[method-assign, assignment]
        RefuseWebSockets(
            ObserveExchanges(
                RefuseAmbiguousLength(ShieldFinalSend(CloseOwned(app.asgi_app))),
                state.metrics,
                log_requests=settings.log_requests,
            )
        )
    )
    add_sglang_routes(app, engine, state)
    app.register_blueprint(openai_blueprint(engine, settings, state.capabilities))
    app.register_blueprint(anthropic_blueprint(engine, settings, state.capabilities))
    app.register_blueprint(openapi_blueprint(version()))

    api_key = settings.api_key.encode() if settings.api_key else None
    admin_key = settings.admin_api_key.encode() if settings.admin_api_key else None

    @app.before_request
    async def before_each_request() -> None:
        # One hook, not three: each hook Quart awaits costs every request a few µs.
        # /metrics and the access log name a route by its rule, so `/v1/models/<id>` is one
        # series whatever ids clients ask for; a path no route matches is "unmatched".
        exchange = exchange_of(request.scope)
        if exchange is not None and request.url_rule is not None:
            exchange.endpoint = request.url_rule.rule
        if api_key is not None or admin_key is not None:
            check_api_key()
        # Keep-alive connections can still carry new requests after shutdown began; they
        # would only be aborted at the deadline, so say no now (health probes still answer).
        if state.draining and request.path in GENERATION_PATHS:
            raise EngineClosed("The server is shutting down.")

    def check_api_key() -> None:
        # As SGLang: health probes stay open; everything else needs the key.
        if request.method == "OPTIONS" or request.path.startswith("/health"):
            return
        if admin_key is not None and request.path in ADMIN_PATHS:
            if not _key_matches([admin_key]):
                raise Unauthorized(
                    "This endpoint changes server state and needs the admin API key."
                )
        elif api_key is not None and not _key_matches([api_key, admin_key]):
            raise Unauthorized()

    # Errors of requests that no blueprint routed (unknown /v1 paths, wrong methods, a missing
    # API key there) reach these app-level handlers: under /v1 they answer in OpenAI's error
    # shape, elsewhere in SGLang's; an unexpected exception, in SGLang's.
    install_error_handlers(
        app, _render_by_path, logger=LOGGER, render_unexpected=engine_error_response
    )
    return app


def _render_by_path(error: EngineError) -> Response:
    if _is_messages(request.path):
        return anthropic_error_response(error)
    if request.path.startswith("/v1/"):
        return openai_error_response(error)
    return engine_error_response(error)


def _is_messages(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def _key_matches(keys: list[bytes | None]) -> bool:
    """The request's `Authorization: Bearer` key, or its `x-api-key` (Anthropic's clients
    send that; llama-server takes it too), is one of `keys` (`auth.py`: constant time)."""
    return any(
        key is not None and (bearer_is(key.decode()) or x_api_key_is(key.decode())) for key in keys
    )
