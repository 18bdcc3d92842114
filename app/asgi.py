"""Two ASGI middlewares that every Tributary app runs under (`create_app` installs them).

`ShieldFinalSend`: hypercorn does its keep-alive bookkeeping inside the send of the final
body message, and Quart-Trio cancels the request on the disconnect event that same send
delivers; unshielded, the idle-timeout task is never armed and idle connections live until
shutdown (trio-stack-notes 2.3). Shielding that one send fixes it; hypercorn already shields
the socket write itself, so nothing new can block.

`CloseOwned`: a view can hand resources (engine request streams) to the HTTP exchange with
`owned_by_request(request.scope).append(x)`; each gets `x.close()` when the exchange ends,
however it ends. This covers the gap a streaming view leaves between returning its response
and Quart entering the body: a client that disconnects there still has its requests aborted.
`close()` must be synchronous and idempotent. A resource that can only be closed with an
`await` (a worker's HTTP response a front relays) has `aclose()` instead: awaited shielded,
after the synchronous ones, so it must be idempotent and bounded in time.
"""

from __future__ import annotations

from typing import Any, Protocol

import trio

__all__ = [
    "AsyncCloseable",
    "CloseOwned",
    "Closeable",
    "Owned",
    "ShieldFinalSend",
    "owned_by_request",
]

_OWNED_KEY = "tributary.owned"

ASGIApp = Any  # (scope, receive, send) -> Awaitable[None]; hypercorn's typing is too strict here


class Closeable(Protocol):
    def close(self) -> None: ...


class AsyncCloseable(Protocol):
    async def aclose(self) -> None: ...


#: What a view can hand to its exchange.
Owned = Closeable | AsyncCloseable


def owned_by_request(scope: Any) -> list[Owned]:
    """The list whose members are closed when this HTTP exchange ends. `scope` is the ASGI
    scope (`request.scope` in a view)."""
    owned: list[Owned] = scope.setdefault(_OWNED_KEY, [])
    return owned


class ShieldFinalSend:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_shielded(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await self.app(scope, receive, send_shielded)


class CloseOwned:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        owned = owned_by_request(scope)
        try:
            await self.app(scope, receive, send)
        finally:
            closing = []
            for resource in owned:
                if hasattr(resource, "aclose"):
                    closing.append(resource)
                else:
                    resource.close()
            if closing:
                with trio.CancelScope(shield=True):
                    for resource in closing:
                        await resource.aclose()
