"""`ServerState`: what the running server knows about itself, shared by the routes and by
`open_http_server` (which marks the start of a graceful shutdown)."""

from __future__ import annotations

import dataclasses

from quart_trio import QuartTrio

from tributary.engine import Capabilities, EngineService

from .observe.metrics import Metrics
from .settings import ServerSettings

__all__ = ["ServerState", "server_state"]

_STATE_KEY = "tributary"


@dataclasses.dataclass
class ServerState:
    #: The engine the app serves.
    engine: EngineService
    #: The settings the app was created with; `open_http_server(app)` listens with them.
    settings: ServerSettings
    #: Set when a graceful shutdown begins; `/health` answers 503 from then on, so load
    #: balancers stop sending new work while in-flight requests finish.
    draining: bool = False
    #: The URLs `open_http_server` bound (with port 0, the real port).
    urls: list[str] = dataclasses.field(default_factory=list)
    #: What `/metrics` serves (None with `enable_metrics` off).
    metrics: Metrics | None = None
    #: What the engine can do beyond `EngineService`, asked once, as the state is made.
    capabilities: Capabilities = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.capabilities = Capabilities.of(self.engine)

    def attach(self, app: QuartTrio) -> None:
        app.extensions[_STATE_KEY] = self


def server_state(app: QuartTrio) -> ServerState:
    """The state of an app made by `create_app`."""
    state: ServerState = app.extensions[_STATE_KEY]
    return state
