"""HTTP helpers of `tributary.testing`: an in-memory client for the app, real servers on port 0,
SSE parsing, and clients that disconnect at a chosen moment. No pytest here.

httpx is needed only by `disconnect_after` (it is imported there), so the rest works
without it.
"""

from __future__ import annotations

import dataclasses
import json as jsonlib
import math
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import trio

from tributary.app import ServerSettings, open_http_server
from tributary.engine import Engine, EngineConfig, open_engine
from tributary.engine.service_nursery import open_service_nursery

from ._engine import sim_config

__all__ = [
    "AppClient",
    "AppResponse",
    "AppStream",
    "RunningServer",
    "SSEParser",
    "disconnect_after",
    "open_server",
    "parse_sse",
    "server_settings",
]

#: How long, in seconds of Trio clock, an app gets to return after its client disconnected.
DISCONNECT_TIMEOUT = 10.0

_NO_JSON = object()


# -- SSE ----------------------------------------------------------------------------------------


class SSEParser:
    """Turns body chunks into the payloads of SSE `data:` events, however the chunks split
    them: a JSON payload is decoded; anything else (`[DONE]`, plain text) stays a string.
    Other fields (`event:`, `id:`, comments) are ignored."""

    def __init__(self) -> None:
        self._buffer = ""

    def feed(self, chunk: bytes | str) -> list[Any]:
        self._buffer += chunk.decode() if isinstance(chunk, bytes) else chunk
        *blocks, self._buffer = self._buffer.replace("\r\n", "\n").split("\n\n")
        events = []
        for block in blocks:
            data = [line[5:].lstrip(" ") for line in block.split("\n") if line.startswith("data:")]
            if data:
                events.append(_decode("\n".join(data)))
        return events


def _decode(payload: str) -> Any:
    if payload == "[DONE]":
        return payload
    try:
        return jsonlib.loads(payload)
    except ValueError:
        return payload


def parse_sse(body: bytes | str) -> list[Any]:
    """A whole SSE body -> its `data:` payloads (see `SSEParser`)."""
    return SSEParser().feed(body)


def _is_frame(event: Any) -> bool:
    """A data event that carries output (not the `[DONE]` marker)."""
    return event != "[DONE]"


# -- the in-memory client --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AppResponse:
    """A whole response from `AppClient.request`."""

    status: int
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self) -> Any:
        return jsonlib.loads(self.body)

    def events(self) -> list[Any]:
        """The body's SSE `data:` payloads (see `SSEParser`)."""
        return parse_sse(self.body)


class AppStream:
    """One exchange with the app, read as it arrives (from `AppClient.stream`).

    Read it either as raw body chunks (`receive`) or as SSE payloads (`next_event`, or
    `async for`), not both. `disconnect()`, or leaving the `stream` block before the body
    has ended, is the client going away: the app gets `http.disconnect`, as Hypercorn sends
    it when a socket closes.
    """

    def __init__(self, app: Any, scope: dict[str, Any], body: bytes) -> None:
        self._app = app
        self._scope = scope
        self._body: bytes | None = body
        self._chunks_send, self._chunks = trio.open_memory_channel[bytes](math.inf)
        self._gone = trio.Event()  # the client left, or the response is complete
        self._app_done = trio.Event()
        self._parser = SSEParser()
        self._pending: list[Any] = []
        #: The response status, once the app has started its response (None before).
        self.status: int | None = None
        #: The response headers (lower-case names), once the response has started.
        self.headers: dict[str, str] = {}
        self._started = trio.Event()
        #: True once the app has sent the last chunk of its body.
        self.complete = False
        #: True once this client has disconnected.
        self.disconnected = False

    async def _run_app(self) -> None:
        try:
            await self._app(self._scope, self._asgi_receive, self._asgi_send)
        finally:
            self._app_done.set()
            self._started.set()
            self._chunks_send.close()

    async def _asgi_receive(self) -> dict[str, Any]:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _asgi_send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            headers: dict[str, str] = {}
            for name, value in message.get("headers", []):
                key = name.decode("latin-1").lower()
                text = value.decode("latin-1")
                headers[key] = f"{headers[key]}, {text}" if key in headers else text
            self.headers = headers
            self._started.set()
        elif message["type"] == "http.response.body":
            if self.disconnected:
                return  # nobody reads any more: dropped, as a closed socket drops it
            if message.get("body"):
                self._chunks_send.send_nowait(message["body"])
            if not message.get("more_body", False):
                self.complete = True
                self._chunks_send.close()
                self._gone.set()  # ASGI: after the response, receive() reports a disconnect

    async def start(self) -> int:
        """Wait until the app has started its response; return its status."""
        await self._started.wait()
        if self.status is None:
            raise AssertionError("the app returned without starting a response")
        return self.status

    async def receive(self) -> bytes:
        """The next body chunk; raises trio.EndOfChannel once the body has ended (or the
        client disconnected)."""
        return await self._chunks.receive()

    async def next_event(self) -> Any:
        """The next SSE `data:` payload; raises trio.EndOfChannel at the end of the body."""
        while not self._pending:
            self._pending.extend(self._parser.feed(await self._chunks.receive()))
        return self._pending.pop(0)

    def __aiter__(self) -> AppStream:
        return self

    async def __anext__(self) -> Any:
        """`async for event in stream`: the SSE payloads up to the end of the body."""
        try:
            return await self.next_event()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def _leave(self) -> None:
        if not self.disconnected and not self.complete:
            self.disconnected = True
            self._gone.set()
            self._chunks_send.close()  # what was received can still be read

    async def disconnect(self, *, timeout: float = DISCONNECT_TIMEOUT) -> None:
        """The client goes away now. Returns once the app has returned (so whatever its
        handler does when cancelled has been done); AssertionError if it has not within
        `timeout` seconds of Trio clock. Idempotent."""
        self._leave()
        with trio.move_on_after(timeout):
            await self._app_done.wait()
            return
        raise AssertionError(f"the app did not return within {timeout} s of the disconnect")


class AppClient:
    """An in-memory HTTP client for a Tributary app (`create_app`, or the `tributary_app`
    fixture): each request runs the app's ASGI callable in a task of the caller's, with no
    socket, so it runs on whatever clock the test runs on (exact under `autojump_clock`).

    It drives the ASGI app itself rather than through Quart's test client, which deadlocks
    on a response of more than 10 chunks that is not read as it arrives, and hangs on exit
    after a disconnect mid-stream. Responses are buffered without limit, so the app never
    waits for the client to read.

    Synopsis::

        client = AppClient(app)
        reply = await client.post("/generate", {"text": "hi", "sampling_params": {...}})
        reply.status, reply.json()
        async with client.stream("POST", "/generate", json={..., "stream": True}) as s:
            first = await s.next_event()          # leaving the block early disconnects
    """

    def __init__(self, app: Any, *, headers: Mapping[str, str] | None = None) -> None:
        self.app = app
        #: Sent with every request (a request's own headers win).
        self.headers = dict(headers or {})

    def _scope(self, method: str, path: str, headers: Mapping[str, str]) -> dict[str, Any]:
        parts = urlsplit(path)
        merged = {"host": "localhost", "user-agent": "tributary-testing"}
        merged.update({k.lower(): v for k, v in self.headers.items()})
        merged.update({k.lower(): v for k, v in headers.items()})
        return {
            "type": "http",
            "http_version": "1.1",
            "asgi": {"spec_version": "2.1"},
            "method": method.upper(),
            "scheme": "http",
            "path": parts.path,
            "raw_path": parts.path.encode(),
            "query_string": parts.query.encode(),
            "root_path": "",
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in merged.items()],
            "client": ("127.0.0.1", 0),
            "server": ("localhost", 80),
            "extensions": {},
        }

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        *,
        json: Any = _NO_JSON,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[AppStream]:
        """Send one request (`json` is encoded, with its content-type) and yield the exchange
        at once, before the app has answered. Leaving the block before the body has ended
        disconnects (see `AppStream.disconnect`); leaving it by an exception, cancellation
        included, disconnects too."""
        headers = dict(headers or {})
        if json is not _NO_JSON:
            body = jsonlib.dumps(json).encode()
            headers.setdefault("content-type", "application/json")
        exchange = AppStream(self.app, self._scope(method, path, headers), body)
        # A service nursery: an error of the caller's block reaches it as itself, not in a group.
        async with open_service_nursery() as nursery:
            nursery.start_soon(exchange._run_app, name=f"app {method} {path}")
            try:
                yield exchange
            finally:
                exchange._leave()
                with trio.move_on_after(DISCONNECT_TIMEOUT) as guard:
                    await exchange._app_done.wait()
                if guard.cancelled_caught and not exchange._app_done.is_set():
                    nursery.cancel_scope.cancel()
                    raise AssertionError(
                        f"the app did not return within {DISCONNECT_TIMEOUT} s of the disconnect"
                    )

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = _NO_JSON,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
    ) -> AppResponse:
        """Send one request and read the whole response."""
        async with self.stream(method, path, json=json, body=body, headers=headers) as s:
            chunks = []
            try:
                while True:
                    chunks.append(await s.receive())
            except trio.EndOfChannel:
                pass
            status = await s.start()
        return AppResponse(status, s.headers, b"".join(chunks))

    async def get(self, path: str, *, headers: Mapping[str, str] | None = None) -> AppResponse:
        return await self.request("GET", path, headers=headers)

    async def post(
        self, path: str, json: Any = _NO_JSON, *, headers: Mapping[str, str] | None = None
    ) -> AppResponse:
        return await self.request("POST", path, json=json, headers=headers)

    async def disconnect_after(
        self,
        path: str,
        json: Any,
        *,
        frames: int | None = None,
        seconds: float | None = None,
        method: str = "POST",
        unary: bool = False,
    ) -> list[Any]:
        """Send a request and go away mid-response: after `frames` SSE data events (not
        counting `[DONE]`), or after `seconds` of Trio clock, whichever comes first (at
        least one of them must be given). Returns once the app has returned, with the events
        read.

        AssertionError if the response ended before the client left (then nothing was cut),
        or if it had not started (no status and headers yet: the disconnect may have come
        before the handler even ran). A unary request's response starts only when it ends:
        pass `unary=True` to leave one mid-generation, and then it is enough that the app
        has read the request.
        """
        _check_moment(frames, seconds)
        events: list[Any] = []
        async with self.stream(method, path, json=json) as s:
            with trio.move_on_after(math.inf if seconds is None else seconds):
                while frames is None or sum(map(_is_frame, events)) < frames:
                    try:
                        events.append(await s.next_event())
                    except trio.EndOfChannel:
                        break
            if s.complete:
                raise AssertionError(
                    f"the response (status {s.status}) ended before the client left: {events!r}"
                )
            if s.status is None and not (unary and s._body is None):
                what = "the app had not read the request" if unary else "no response headers"
                raise AssertionError(f"the response had not started when the client left ({what})")
            await s.disconnect()
        return events


def _check_moment(frames: int | None, seconds: float | None) -> None:
    if frames is None and seconds is None:
        raise TypeError("say when to disconnect: frames=N, seconds=T, or both")


# -- real servers ------------------------------------------------------------------------------


def server_settings(**overrides: Any) -> ServerSettings:
    """`ServerSettings` for tests: port 0 (a free port) and a 1 s graceful shutdown, with
    `overrides` (any ServerSettings field) applied."""
    settings: dict[str, Any] = {"port": 0, "graceful_timeout": 1.0}
    settings.update(overrides)
    return ServerSettings(**settings)


@dataclasses.dataclass(frozen=True)
class RunningServer:
    """A real Hypercorn serving `engine` (from `open_server` or the `tributary_server`
    fixture)."""

    engine: Engine
    url: str  # http://127.0.0.1:<port>, no trailing slash
    urls: tuple[str, ...]


@asynccontextmanager
async def open_server(
    config: EngineConfig | None = None,
    settings: ServerSettings | None = None,
    *,
    engine: Engine | None = None,
) -> AsyncIterator[RunningServer]:
    """A real Hypercorn on a free port serving `engine`, or a new engine opened with
    `config` (default: `sim_config()`); shut down gracefully on exit (the engine too, if
    this opened it). It runs on real sockets: use it on Trio's real clock, not under
    `autojump_clock`."""
    settings = settings or server_settings()
    if engine is None:
        async with open_engine(config or sim_config()) as opened:
            async with open_http_server(opened, settings) as urls:
                yield RunningServer(opened, urls[0], tuple(urls))
    else:
        async with open_http_server(engine, settings) as urls:
            yield RunningServer(engine, urls[0], tuple(urls))


async def disconnect_after(
    url: str,
    json: Any,
    *,
    frames: int | None = None,
    seconds: float | None = None,
    headers: Mapping[str, str] | None = None,
    unary: bool = False,
) -> list[Any]:
    """POST `json` to `url` over a real socket (httpx, a connection of its own) and close the
    connection mid-response: after `frames` SSE data events (not counting `[DONE]`), or after
    `seconds`, whichever comes first (at least one must be given). Returns the events read,
    once the connection is closed; what the server then does is up to it (a Tributary server
    aborts the request's sequences at the next step boundary).

    AssertionError if the response ended before the client left (then nothing was cut), or
    if no response headers had arrived (the disconnect may have come before the handler
    even ran). A unary request's response starts only when it ends: pass `unary=True` to
    leave one mid-generation, and then it is enough that the whole request was sent.
    """
    import httpx

    _check_moment(frames, seconds)
    events: list[Any] = []
    parser = SSEParser()
    ended = started = sent = False

    async def trace(event: str, info: Any) -> None:
        nonlocal sent
        if event.endswith("send_request_body.complete"):
            sent = True

    async with httpx.AsyncClient(timeout=None) as client:
        with trio.move_on_after(math.inf if seconds is None else seconds):
            async with client.stream(
                "POST", url, json=json, headers=headers, extensions={"trace": trace}
            ) as response:
                started = True
                async for chunk in response.aiter_bytes():
                    events.extend(parser.feed(chunk))
                    if frames is not None and sum(map(_is_frame, events)) >= frames:
                        break
                else:
                    ended = True
    if ended or "[DONE]" in events:
        raise AssertionError(f"the response ended before the client left: {events!r}")
    if not started and not (unary and sent):
        what = "the request had not been sent" if unary else "no response headers"
        raise AssertionError(f"the response had not started when the client left ({what})")
    return events
