"""While the model loads, the port already answers: 503 for every request.

Synopsis::

    loaded, released = trio.Event(), trio.Event()
    urls = await nursery.start(serve_until_loaded, settings, loaded, released)
    async with engine.open_engine(config) as eng:      # takes a while
        loaded.set()
        await released.wait()                          # the port is free again
        settings = dataclasses.replace(settings, port=bound_port(urls[0]))
        async with open_http_server(eng, settings) as urls: ...

Health checks (Kubernetes, load balancers, `just serve` watchers) then see "not ready"
rather than a refused connection, as with llama.cpp's server. The placeholder is a raw ASGI
app on Hypercorn, not the Quart app, because the Quart app needs the engine to exist.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any
from urllib.parse import urlsplit

import trio
from hypercorn.trio import serve as hypercorn_serve

from .server import hypercorn_config
from .settings import ServerSettings

__all__ = ["LOADING_MESSAGE", "bound_port", "loading_app", "serve_until_loaded"]

LOADING_MESSAGE = "The model is loading; retry shortly."
_BODY = json.dumps({"error": {"message": LOADING_MESSAGE, "code": 503}}).encode()
_HEADERS = [
    (b"content-type", b"application/json"),
    (b"retry-after", b"1"),
    (b"content-length", str(len(_BODY)).encode()),
]


async def loading_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    elif scope["type"] == "http":
        await send({"type": "http.response.start", "status": 503, "headers": _HEADERS})
        await send({"type": "http.response.body", "body": _BODY})


async def serve_until_loaded(
    settings: ServerSettings,
    loaded: trio.Event,
    released: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer 503 on `settings`' address until `loaded` is set, then close the listener and
    set `released`. Reports the bound URLs (with port 0, the port picked) via `task_status`."""
    config = hypercorn_config(dataclasses.replace(settings, graceful_timeout=0.5))
    try:
        await hypercorn_serve(
            loading_app, config, shutdown_trigger=loaded.wait, task_status=task_status
        )
    finally:
        released.set()


def bound_port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port
