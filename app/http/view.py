"""`ViewRequest`: what a view that generates hands its handler, read in one place.

Synopsis::

    @bp.route("/messages", methods=["POST"])
    async def messages() -> Response:
        return await create_message(served, await ViewRequest.read(settings))

The handler owns nothing it is given: `owned` is the exchange's list (`asgi.owned_by_request`),
whose members are closed when the exchange ends, so a stream appended to it is aborted even if
the client leaves before the body starts. Before the first byte a handler fails by raising an
`engine.EngineError` (its blueprint's error handlers answer in its API's shape); past the
deadline it answers a 408 (the status, or a stream's error event).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from quart import request

from ..observe.exchange import Exchange, exchange_of
from ..settings import ServerSettings
from .asgi import Owned, owned_by_request
from .body import read_within_deadline
from .limits import Deadline

__all__ = ["ViewRequest"]


@dataclasses.dataclass(frozen=True, slots=True)
class ViewRequest:
    #: The JSON body, read within the deadline.
    body: Any
    #: The request's deadline (`--request-timeout`, `X-Request-Timeout`).
    deadline: Deadline
    #: What the exchange closes when it ends: append every stream submitted for it.
    owned: list[Owned]
    #: Where the request's timing goes (None outside `ObserveExchanges`).
    exchange: Exchange | None

    @classmethod
    async def read(cls, settings: ServerSettings) -> ViewRequest:
        """The current request's (in a view): its body read within its deadline."""
        body, deadline = await read_within_deadline(settings)
        scope = request.scope
        return cls(body, deadline, owned_by_request(scope), exchange_of(scope))
