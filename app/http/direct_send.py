"""`DirectSend`: Hypercorn's writes to a connection go straight to the socket when it takes them.

Synopsis::

    app.asgi_app = DirectSend(app.asgi_app)      # outermost: it needs Hypercorn's own `send`

Hypercorn's trio worker writes every piece of a response (the head, each body message, the
end of the body) with `TCPServer.protocol_send`: it takes the connection's send lock and
calls `SocketStream.send_all`, which yields to Trio's run loop twice (the lock's checkpoint,
the socket's). Those passes cost about 20 µs of CPU a write on these machines, more than the
`write` itself; a token stream writes once per token, and on two cores that CPU is taken
from llama.cpp's decode.

For the length of each exchange on a plain-TCP HTTP/1.1 connection, this middleware gives
Hypercorn's h11 protocol a writer that first tries one non-blocking `write` to the socket,
when no other write is under way (the lock is free), and returns without yielding if the
socket took all of it. Otherwise (the socket's buffer is full, the connection is closed or
broken, another write holds the lock) what is left goes through `protocol_send` as before:
the lock, a shielded `send_all`, and Hypercorn's handling of a connection that broke. A
write begun is always finished, shielded from cancellation like Hypercorn's own. The lock
keeps the bytes in order when another task writes to the connection meanwhile (Hypercorn's
reading task answers `Expect: 100-continue` itself): it is held from before that write
yields until it is done, and Trio hands it over first come, first served. An empty
write (h11's end of a Content-Length body) is skipped: the bytes h11 produced all went out.

Everything above the socket stays Hypercorn's and h11's (framing, keep-alive and idle
timers, the events middlewares see); only the last step changes. When the exchange ends the
protocol gets its own `send` back, so nothing of Tributary's stays attached to a connection
(Hypercorn's connection objects only go away with the cycle collector). The internals this
relies on are checked, never assumed, and only the Hypercorn versions it was written
against (`HYPERCORN_VERSIONS`) get it: under any other server (Quart's test client, TLS,
HTTP/2, another Hypercorn) writes take the usual path.

A direct write is not a checkpoint, so a body that produced chunks without ever waiting
would not yield between them. Tributary's bodies are `StreamedBody`s (streamed.py), which
checkpoint before every chunk.

`BodyChunks` goes one step further for a streamed body, from synchronous code: once the
response head is out and the body's task is waiting for the engine (so no other write of the
exchange is under way), a token's event can be framed by h11's own body writer and written
at the moment the engine delivers it, without waking the body's task and passing the chunk
through Quart's response loop, the ASGI middlewares and Hypercorn's stream (none of which
does anything with a body chunk but hand it on). Whatever the socket does not take at once
goes back to the body's task, which sends it through the usual path.
"""

from __future__ import annotations

import contextvars
import logging
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import h11
import trio

try:  # Hypercorn's internals: a release that moved them still serves, without this path
    from hypercorn.events import Event, RawData
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.protocol.http_stream import HTTPStream
    from hypercorn.trio.tcp_server import TCPServer
except ImportError:
    _INTERNALS = False
else:
    _INTERNALS = True

__all__ = [
    "H11_VERSIONS",
    "HYPERCORN_VERSIONS",
    "BodyChunks",
    "DirectSend",
    "DirectWriter",
    "body_chunks",
    "h11_protocol",
]

ASGIApp = Any

#: Hypercorn releases whose `TCPServer.protocol_send` this was checked against (its RawData
#: branch: the lock, a shielded `send_all`, `Closed` on a broken stream).
HYPERCORN_VERSIONS = ("0.18.",)


#: h11 releases whose `Connection` keeps its body writer in `_writer` and changes no state
#: of its own for a body chunk (`BodyChunks` frames chunks with that writer, bypassing
#: `Connection.send`).
H11_VERSIONS = ("0.14.", "0.16.")


def _supported() -> bool:
    try:
        installed = version("hypercorn")
    except PackageNotFoundError:
        return False
    return _INTERNALS and os.name == "posix" and installed.startswith(HYPERCORN_VERSIONS)


def _h11_supported() -> bool:
    return h11.__version__.startswith(H11_VERSIONS) and hasattr(
        h11.Connection(h11.SERVER), "_writer"
    )


H11_SUPPORTED = _h11_supported()


SUPPORTED = _supported()


logger = logging.getLogger("tributary.app")


class DirectSend:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        if not SUPPORTED and os.name == "posix":
            logger.warning(
                "The fast write path is off: it supports Hypercorn %s on POSIX, not the "
                "Hypercorn installed here; responses take Hypercorn's usual path.",
                " / ".join(f"{v}x" for v in HYPERCORN_VERSIONS),
            )

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        protocol = h11_protocol(send) if scope["type"] == "http" else None
        if protocol is None:
            await self.app(scope, receive, send)
            return
        # The exchange before this one on the connection may still be finishing (its
        # response is out, its handler not yet returned): then both use its writer, and the
        # last to end gives the protocol its own send back.
        writer = protocol.send
        if not isinstance(writer, DirectWriter):
            writer = protocol.send = DirectWriter(protocol.send)
        writer.exchanges += 1
        token = _BODY_CHUNKS.set(BodyChunks(writer, protocol) if H11_SUPPORTED else None)
        try:
            await self.app(scope, receive, send)
        finally:
            _BODY_CHUNKS.reset(token)
            writer.exchanges -= 1
            if not writer.exchanges and protocol.send is writer:
                protocol.send = writer.protocol_send


#: The exchange's `BodyChunks`, for the handler's response body (Trio tasks inherit it).
_BODY_CHUNKS: contextvars.ContextVar[BodyChunks | None] = contextvars.ContextVar(
    "tributary_body_chunks", default=None
)


def body_chunks() -> BodyChunks | None:
    """The current exchange's `BodyChunks` (None where `DirectSend` does not apply)."""
    return _BODY_CHUNKS.get()


def h11_protocol(send: Any) -> H11Protocol | None:
    """The h11 protocol of the connection behind Hypercorn's ASGI `send`, if it is HTTP/1.1
    over plain TCP and its `send` is its server's `protocol_send` (as the server's class
    defines it at the time, so a subclass's or a test's replacement counts) or already a
    `DirectWriter`; None for anything else."""
    if not SUPPORTED:
        return None
    stream = getattr(send, "__self__", None)
    if not isinstance(stream, HTTPStream):
        return None
    protocol = getattr(stream.send, "__self__", None)
    if not isinstance(protocol, H11Protocol):
        return None
    if isinstance(protocol.send, DirectWriter):
        return protocol
    server = getattr(protocol.send, "__self__", None)
    if (
        not isinstance(server, TCPServer)
        or getattr(protocol.send, "__func__", None) is not type(server).protocol_send
        or not isinstance(getattr(server, "send_lock", None), trio.Lock)
        or not isinstance(getattr(server, "stream", None), trio.SocketStream)
    ):
        return None
    return protocol


class DirectWriter:
    """Stands in for `TCPServer.protocol_send` (bound) as the h11 protocol's `send`."""

    def __init__(self, protocol_send: Any) -> None:
        self.protocol_send = protocol_send
        self.exchanges = 0  # how many exchanges use it (DirectSend's bookkeeping)
        server = protocol_send.__self__
        self._lock = server.send_lock
        self._socket = server.stream.socket

    async def __call__(self, event: Event) -> None:
        if type(event) is RawData and not self._lock.locked():
            data = event.data
            if not data:
                return
            fd = self._socket.fileno()
            written = 0
            if fd >= 0:  # -1: closed; protocol_send reports it
                try:
                    written = os.write(fd, data)
                except OSError:  # EAGAIN, or broken: protocol_send waits or reports it
                    pass
            if written == len(data):
                return
            if written:
                with trio.CancelScope(shield=True):
                    await self.protocol_send(RawData(data=data[written:]))
                return
        await self.protocol_send(event)


class BodyChunks:
    """Writes one exchange's body chunks straight to the socket, from synchronous code.

    The caller promises that no other write of the exchange is under way: the response head
    has been sent (by the usual path) and the body's task is parked waiting for more. A chunk
    is framed by the h11 connection's own body writer (chunked, or HTTP/1.0's raw bytes) and
    written with one non-blocking `write`, only while h11 is sending the body, the
    connection's send lock is free and this exchange's writer is still installed (`ready`).
    h11 itself is not told: sending a body chunk changes none of its state but the body
    writer's own (which frames it).
    """

    def __init__(self, writer: DirectWriter, protocol: H11Protocol) -> None:
        self._writer = writer
        self._protocol = protocol

    def ready(self) -> bool:
        """Whether a chunk may be written now: h11 is sending the body, this exchange's
        writer is installed and no other write holds the connection's lock."""
        writer = self._writer
        connection = self._protocol.connection
        return (
            isinstance(connection, h11.Connection)
            and connection.our_state is h11.SEND_BODY
            and self._protocol.send is writer
            and not writer._lock.locked()
            and connection._writer is not None
            and writer._socket.fileno() >= 0
        )

    def write(self, data: bytes) -> bytes:
        """Write `data` as the next body chunk (after `ready`); return what the socket did
        not take at once (b"": all of it went), which `send_rest` must send before anything
        else of the exchange."""
        parts: list[bytes] = []
        connection = self._protocol.connection
        assert isinstance(connection, h11.Connection) and connection._writer is not None
        connection._writer(h11.Data(data=data), parts.append)
        framed = b"".join(parts)
        try:
            written = os.write(self._writer._socket.fileno(), framed)
        except OSError:  # EAGAIN, or broken: protocol_send waits or reports it
            written = 0
        return framed[written:]

    async def send_rest(self, rest: bytes) -> None:
        """Finish a chunk `write` began (shielded: a write begun is always finished)."""
        with trio.CancelScope(shield=True):
            await self._writer.protocol_send(RawData(data=rest))
