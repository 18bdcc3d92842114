"""`add_sglang_routes`: SGLang's native API, `/generate` and the endpoints around it.

Routes (docs/api.md has the wire details): `/generate` and `/encode` (POST, PUT) here (the
latter's body and answer in `encode.py`); the endpoints around it (`/health`,
`/get_model_info`, `/abort_request`, ...) in `admin.py`; `/tokenize` and `/detokenize` in
`tokenize.py`.

Errors: a view raises `engine.EngineError` (or a subclass) for anything wrong with a request;
the app's handlers (`app/routes.py`) answer it in SGLang's shape, `errors.py`.
`/tokenize` and `/detokenize` answer in their own (SGLang's OpenAI-layer `ErrorResponse`).
"""

from __future__ import annotations

from quart import Quart, Response, request

from tributary.engine import EngineService

from ..http.asgi import owned_by_request
from ..http.body import read_within_deadline
from ..observe.exchange import exchange_of
from ..state import ServerState
from .admin import admin_blueprint
from .encode import handle_encode
from .generate import handle_generate
from .tokenize import tokenize_blueprint

__all__ = ["add_sglang_routes"]


def add_sglang_routes(app: Quart, engine: EngineService, state: ServerState) -> None:
    """SGLang's native API for `engine`, on the app serving that engine. `/generate` is a
    route of the app itself and the endpoints around it two blueprints beside it, none
    nested: Quart walks a request's blueprint chain for its hooks and handlers, and each
    level costs every request a few µs."""
    settings = state.settings
    tokenizer = state.capabilities.tokenizer

    async def generate() -> Response:
        body, deadline = await read_within_deadline(settings)
        return await handle_generate(
            engine,
            settings,
            body,
            owned_by_request(request.scope),
            exchange_of(request.scope),
            tokenizer=tokenizer,
            deadline=deadline,
        )

    app.add_url_rule("/generate", view_func=generate, methods=["POST", "PUT"])

    caps = state.capabilities
    no_embeddings = (
        "This server fronts a fleet of workers and relays /v1/embeddings to them; call "
        "/encode on a worker."
        if caps.passthrough is not None
        else "This engine does not compute embeddings: its runner has none."
    )

    async def encode() -> Response:
        body, deadline = await read_within_deadline(settings)
        return await handle_encode(
            caps.embeddings,
            tokenizer,
            body,
            exchange_of(request.scope),
            model_name=engine.model_info.name,
            deadline=deadline,
            unavailable=no_embeddings,
        )

    app.add_url_rule("/encode", view_func=encode, methods=["POST", "PUT"])
    app.register_blueprint(admin_blueprint(engine, state))
    app.register_blueprint(tokenize_blueprint(engine, tokenizer))
