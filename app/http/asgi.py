"""The ASGI middlewares that every Tributary app runs under (`create_app` installs them).

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

`RefuseWebSockets`: Tributary serves no WebSocket route, but Hypercorn hands any valid
upgrade request (on any path, before any API key check) to the app as a `websocket` scope,
which Quart answered with a 500 and a logged traceback. It is refused before the app sees
it, with the ASGI close-before-accept that Hypercorn turns into a 403 (as Starlette, so
SGLang and vLLM, answer), and nothing is logged.

`RefuseAmbiguousLength`: a request carrying both `Content-Length` and `Transfer-Encoding`
is framed differently by different HTTP parsers (h11 follows Transfer-Encoding; a proxy in
front may follow Content-Length), the basis of request smuggling. RFC 9112 section 6.3
lets a server reject it and requires it to close the connection after responding: it gets
a 400 with `Connection: close` (h11 then refuses to start another exchange on the
connection and Hypercorn closes it), and the bytes after its body are never read as a
request.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import trio

__all__ = [
    "AMBIGUOUS_LENGTH",
    "AsyncCloseable",
    "CloseOwned",
    "Closeable",
    "Owned",
    "RefuseAmbiguousLength",
    "RefuseWebSockets",
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


class RefuseWebSockets:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        await receive()  # websocket.connect
        # Closed before it was accepted: the server answers the upgrade request with a 403.
        await send({"type": "websocket.close", "code": 1008})


#: The 400's message for a request with both framing headers.
AMBIGUOUS_LENGTH = (
    "A request must not carry both Content-Length and Transfer-Encoding (RFC 9112 section 6.3)."
)


class RefuseAmbiguousLength:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not _both_framing_headers(scope["headers"]):
            await self.app(scope, receive, send)
            return
        body: dict[str, Any]
        if scope["path"].startswith("/v1/"):  # OpenAI's error shape there, SGLang's elsewhere
            error = {"message": AMBIGUOUS_LENGTH, "type": "invalid_request_error"}
            body = {"error": {**error, "param": None, "code": None}}
        else:
            body = {"error": {"message": AMBIGUOUS_LENGTH, "code": 400}}
        data = json.dumps(body).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 400, "headers": headers})
        await send({"type": "http.response.body", "body": data})


def _both_framing_headers(headers: list[tuple[bytes, bytes]]) -> bool:
    length = encoding = False
    for name, _ in headers:
        lowered = name.lower()
        length = length or lowered == b"content-length"
        encoding = encoding or lowered == b"transfer-encoding"
    return length and encoding
