"""Serving an app over HTTP inside a Trio program: `open_http_server` and `serve`.

Synopsis::

    async with engine.open_engine(EngineConfig()) as eng:
        async with open_http_server(eng, ServerSettings(port=0)) as urls:
            ...                                   # serving at urls[0] until the block exits

    # or, as a service with the task_status convention:
    urls = await nursery.start(serve, eng, ServerSettings(port=0))

Lifecycle contract:

- the engine must already be open (its model loaded): nothing serves before it can answer;
- a chat template that cannot render a one-message chat raises `UnusableChatTemplate` (a
  ValueError) before anything listens (app/chat/template_check.py);
- leaving the block normally is a graceful shutdown: `/health` turns 503, the listener
  closes, and in-flight requests get `settings.graceful_timeout` seconds. Early enough for
  a 503 to leave before that deadline (at 80% of it, or two of the slowest recent engine
  steps before it, or at once: `abort_delay`), whatever is still generating is aborted with
  status 503, so a stream still open ends with an error item and `[DONE]` and a unary
  request gets a 503, instead of a cut connection; at the deadline anything left is
  cancelled;
- cancelling the block is a hard stop within one scheduling round;
- an error raised in the block reaches the caller as itself, not wrapped in a group.

Hypercorn is configured around measured traps (trio-stack-notes 2.3, 2.4): listening sockets
carry TCP_USER_TIMEOUT, so a peer that stops reading cannot pin a shielded write (and
shutdown) for ever; the app runs under `ShieldFinalSend`, so keep-alive idle timeouts work.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio import serve as hypercorn_serve
from quart_trio import QuartTrio

from tributary.engine import EngineService
from tributary.engine.service_nursery import open_service_nursery

from .chat.template_check import check_chat_template
from .routes import create_app
from .settings import ServerSettings
from .state import server_state

__all__ = ["ServerConfig", "open_http_server", "serve"]


class ServerConfig(Config):
    """Hypercorn's Config whose TCP listening sockets set TCP_USER_TIMEOUT (Linux copies it to
    every accepted socket)."""

    user_timeout_ms = 30_000

    def create_sockets(self) -> Sockets:
        sockets = super().create_sockets()
        for sock in sockets.insecure_sockets + sockets.secure_sockets:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and hasattr(
                socket, "TCP_USER_TIMEOUT"
            ):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, self.user_timeout_ms)
        return sockets


def hypercorn_config(settings: ServerSettings) -> ServerConfig:
    config = ServerConfig()
    config.bind = [settings.bind]
    config.accesslog = None
    # A plain logger: the embedding program's logging config decides where it goes (hypercorn
    # would otherwise install its own stderr handler on it).
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = settings.graceful_timeout
    config.keep_alive_timeout = settings.keep_alive_timeout
    config.user_timeout_ms = int(settings.tcp_user_timeout * 1000)
    return config


@asynccontextmanager
async def open_http_server(
    engine_or_app: EngineService | QuartTrio, settings: ServerSettings | None = None
) -> AsyncIterator[list[str]]:
    """Serve until the block exits; yield the bound URLs (port 0 gives a free port).

    Given an app from `create_app`, `settings` defaults to the ones it was created with.
    """
    if isinstance(engine_or_app, QuartTrio):
        app = engine_or_app
        settings = settings or server_state(app).settings
    else:
        settings = settings or ServerSettings()
        check_chat_template(engine_or_app)  # UnusableChatTemplate before anything listens
        app = create_app(engine_or_app, settings)
    state = server_state(app)
    shutdown = trio.Event()
    async with open_service_nursery() as nursery:

        async def run_hypercorn(*, task_status: trio.TaskStatus[list[str]]) -> None:
            config = hypercorn_config(settings)
            await hypercorn_serve(
                app, config, shutdown_trigger=shutdown.wait, task_status=task_status
            )
            nursery.cancel_scope.cancel()  # drained: stop the leftover timer below

        binds: list[str] = await nursery.start(run_hypercorn)
        state.urls = binds
        try:
            yield binds
        finally:
            state.draining = True
            shutdown.set()
            nursery.start_soon(abort_leftovers, state.engine, settings.graceful_timeout)


#: The share of the graceful timeout left for aborted requests' 503s to reach their clients.
ABORT_MARGIN_SHARE = 0.2
#: ... and at least this many of the engine's slowest recent steps: an abort acts at the next
#: step boundary, so the step running when it is marked must end (and the 503 be written)
#: before the deadline.
ABORT_MARGIN_STEPS = 2.0


SHUTTING_DOWN = "The server is shutting down."


def abort_delay(graceful_timeout: float, slowest_step: float) -> float:
    """Seconds after a graceful shutdown begins to abort what still generates: the deadline
    less max(20% of it, two of the slowest recent steps); 0 (at once) if that is past."""
    margin = max(ABORT_MARGIN_SHARE * graceful_timeout, ABORT_MARGIN_STEPS * slowest_step)
    return max(0.0, graceful_timeout - margin)


async def abort_leftovers(engine: EngineService, graceful_timeout: float) -> None:
    """End what still generates before the graceful deadline with a 503 the client can read.

    Requests still queued get their 503 at once: admitted while draining, a queued prompt's
    first prefill chunk could take longer than any step measured so far, and an abort only
    takes effect at a step boundary (its client would then be cut off instead). The running
    ones carry on until the deadline less a margin from the step times measured when
    shutdown begins (a large model or a long prefill chunk makes steps long); while draining
    nothing new is admitted, so steps do not grow meanwhile."""
    engine.abort_waiting(message=SHUTTING_DOWN, status_code=503)
    await trio.sleep(abort_delay(graceful_timeout, engine.slowest_recent_step()))
    engine.abort_all(message=SHUTTING_DOWN, status_code=503)


async def serve(
    engine_or_app: EngineService | QuartTrio,
    settings: ServerSettings | None = None,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled (a hard stop). Reports the bound URLs through `task_status`."""
    async with open_http_server(engine_or_app, settings) as urls:
        task_status.started(urls)
        await trio.sleep_forever()
