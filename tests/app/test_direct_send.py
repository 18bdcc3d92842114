"""DirectSend: Hypercorn's writes go straight to the socket when it takes them at once, and
what reaches the client is a correct response (framing, content, keep-alive).

The responses are read with h11, which rejects any framing error, from a real Hypercorn;
keep-alive must survive (Hypercorn's and h11's state stayed right).
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from types import SimpleNamespace
from typing import Any

import h11
import pytest
import trio
import trio.testing
from apphelpers import Server, greedy, parse_sse, post_until_closed, raw_socket, wait_until
from hypercorn.events import RawData, Updated
from hypercorn.trio.tcp_server import TCPServer

from tributary.app.http import direct_send

TOKENS = 64


def stream_body(tokens: int = TOKENS, text: str = "direct") -> bytes:
    return json.dumps({"text": text, "stream": True, "sampling_params": greedy(tokens)}).encode()


class RawClient:
    """One keep-alive connection, its responses parsed by h11 (client side)."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def connect(cls, url: str) -> RawClient:
        return cls(await raw_socket(url))

    async def post(
        self, path: str, body: bytes, *, pause: float = 0.0
    ) -> tuple[h11.Response, bytes]:
        """Send a POST; with `pause`, read the response head and then nothing for that long.
        Returns the response and its whole body (h11 has checked the framing)."""
        if self.h11.our_state is h11.DONE:
            self.h11.start_next_cycle()
        request = h11.Request(
            method="POST",
            target=path,
            headers=[
                ("host", "test"),
                ("content-type", "application/json"),
                ("content-length", str(len(body))),
            ],
        )
        await self.sock.send(self.h11.send(request) + self.h11.send(h11.Data(data=body)))
        await self.sock.send(self.h11.send(h11.EndOfMessage()))
        response: h11.Response | None = None
        data = bytearray()
        with trio.fail_after(30):
            while True:
                event = self.h11.next_event()
                if event is h11.NEED_DATA:
                    if response is not None and pause:
                        await trio.sleep(pause)
                        pause = 0.0
                    self.h11.receive_data(await self.sock.recv(1 << 16))
                elif isinstance(event, h11.Response):
                    response = event
                elif isinstance(event, h11.Data):
                    data += event.data
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    assert response is not None
                    return response, bytes(data)

    def close(self) -> None:
        self.sock.close()


def header(response: h11.Response, name: bytes) -> bytes | None:
    return next((v for n, v in response.headers if n == name), None)


def check_stream(body: bytes, tokens: int = TOKENS) -> None:
    """Every event parses; text only grows (cumulative mode); the last frame has all tokens."""
    events = parse_sse(body.decode())
    assert events[-1] == "[DONE]"
    frames = events[:-1]
    texts = [f["text"] for f in frames]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert frames[-1]["meta_info"]["completion_tokens"] == tokens
    assert frames[-1]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.fixture
def locked_writes(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The events that reach Hypercorn's `protocol_send` (its lock and `send_all`), by type."""
    sent: Counter[str] = Counter()
    original = TCPServer.protocol_send

    async def counting(self: TCPServer, event: Any) -> None:
        sent[type(event).__name__] += 1
        if isinstance(event, Updated):
            sent["idle" if event.idle else "busy"] += 1
        await original(self, event)

    monkeypatch.setattr(TCPServer, "protocol_send", counting)
    return sent


async def test_writes_skip_hypercorns_lock_and_keep_alive_holds(
    sim_server: Server, locked_writes: Counter[str]
) -> None:
    client = await RawClient.connect(sim_server.url)
    try:
        response, body = await client.post("/generate", stream_body())
        assert response.status_code == 200
        assert header(response, b"transfer-encoding") == b"chunked"
        check_stream(body)

        # The same connection carries a unary request and another stream.
        response, body = await client.post(
            "/generate", json.dumps({"text": "then", "sampling_params": greedy(4)}).encode()
        )
        assert response.status_code == 200
        assert json.loads(body)["meta_info"]["completion_tokens"] == 4
        response, body = await client.post("/generate", stream_body(text="again"))
        check_stream(body)
        # Every byte went straight to the socket; Hypercorn's keep-alive bookkeeping still
        # ran: each request marked the connection busy, each response's end marked it idle
        # again. The last idle follows its bytes: wait for it while the connection is open
        # (a client that has closed may be seen first, and then no idle is due).
        await wait_until(lambda: locked_writes["idle"] == 3)
    finally:
        client.close()
    assert locked_writes["RawData"] == 0
    assert locked_writes["busy"] == 3


async def test_short_and_refused_writes_still_give_an_intact_stream(
    sim_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The socket takes part of a chunk, or nothing: the rest goes Hypercorn's way and the
    client still reads every chunk whole, in order."""
    calls = Counter[str]()

    def flaky_write(fd: int, data: bytes) -> int:
        calls["write"] += 1
        if calls["write"] % 3 == 0:
            calls["refused"] += 1
            raise BlockingIOError
        if len(data) > 8 and calls["write"] % 3 == 1:
            calls["short"] += 1
            return os.write(fd, data[: len(data) // 2])
        return os.write(fd, data)

    monkeypatch.setattr(direct_send, "os", SimpleNamespace(write=flaky_write))
    client = await RawClient.connect(sim_server.url)
    try:
        for text in ("first", "second"):  # the second on the same connection
            response, body = await client.post("/generate", stream_body(text=text))
            assert response.status_code == 200
            check_stream(body)
        response, body = await client.post(
            "/generate", json.dumps({"text": "unary", "sampling_params": greedy(4)}).encode()
        )
        assert json.loads(body)["meta_info"]["completion_tokens"] == 4
    finally:
        client.close()
    assert calls["short"] >= 10 and calls["refused"] >= 10


async def test_a_reader_that_pauses_gets_every_chunk_intact(
    sim_server: Server, locked_writes: Counter[str]
) -> None:
    """A client that stops reading until the kernel's buffers are full, then reads on: the
    server's writes went short and waited, and nothing was lost or torn."""
    tokens = 1500  # cumulative frames: far more than a 4 KiB receive buffer holds
    client = RawClient(await raw_socket(sim_server.url, receive_buffer=4096))
    try:
        response, body = await client.post(
            "/generate", stream_body(tokens, text="x" * 50), pause=0.5
        )
        assert response.status_code == 200
        check_stream(body, tokens)
    finally:
        client.close()
    assert locked_writes["RawData"] > 0  # the socket was full: some writes had to wait


async def test_an_http10_client_gets_the_stream_unframed(
    sim_server: Server, locked_writes: Counter[str]
) -> None:
    """No chunked encoding in HTTP/1.0: the body is the bare events, ended by the close."""
    received = await post_until_closed(sim_server.url, stream_body(), version=b"1.0")
    head, _, content = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    check_stream(content)
    assert locked_writes["RawData"] == 0  # written directly all the same


async def test_nothing_is_installed_outside_hypercorn() -> None:
    async def send(message: dict[str, Any]) -> None:
        pass

    assert direct_send.h11_protocol(send) is None
    assert direct_send.h11_protocol(SimpleNamespace(__self__=object())) is None


async def test_an_unsupported_hypercorn_gets_its_usual_writes(
    sim_server: Server, locked_writes: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(direct_send, "SUPPORTED", False)
    client = await RawClient.connect(sim_server.url)
    try:
        _, body = await client.post("/generate", stream_body())
    finally:
        client.close()
    check_stream(body)
    assert locked_writes["RawData"] > TOKENS // 2


class FakeServer:
    """What a DirectWriter uses of Hypercorn's TCPServer, over one end of a socket pair."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.send_lock = trio.Lock()
        self.stream = trio.SocketStream(sock)
        self.locked: list[bytes] = []

    async def protocol_send(self, event: RawData) -> None:
        async with self.send_lock:
            with trio.CancelScope(shield=True):
                await self.stream.send_all(event.data)
                self.locked.append(event.data)


async def test_a_write_waits_its_turn_behind_another_tasks_write() -> None:
    """Another task holds the lock (its write is under way): the writer queues behind it
    instead of writing first, so the bytes keep their order."""
    ours, theirs = trio.socket.socketpair()
    server = FakeServer(ours)
    writer = direct_send.DirectWriter(server.protocol_send)
    received = bytearray()
    async with trio.open_nursery() as nursery:
        await server.send_lock.acquire()  # "100 Continue" is being written
        nursery.start_soon(writer, RawData(data=b"response head"))
        await trio.testing.wait_all_tasks_blocked()
        assert server.locked == []  # nothing written past the holder
        await server.stream.send_all(b"100 continue|")
        server.send_lock.release()
    assert server.locked == [b"response head"]
    await writer(RawData(data=b"|body"))  # the lock is free: straight to the socket
    assert server.locked == [b"response head"]
    ours.close()
    while data := await theirs.recv(1 << 16):
        received += data
    assert received == b"100 continue|response head|body"


async def test_a_write_begun_is_finished_under_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The socket took half; the caller is cancelled meanwhile; the other half still goes."""
    ours, theirs = trio.socket.socketpair()
    server = FakeServer(ours)
    writer = direct_send.DirectWriter(server.protocol_send)
    monkeypatch.setattr(
        direct_send, "os", SimpleNamespace(write=lambda fd, data: os.write(fd, data[:4]))
    )
    with trio.CancelScope() as scope:
        scope.cancel()
        await writer(RawData(data=b"half and the rest"))
    assert server.locked == [b" and the rest"]
    ours.close()
    received = b""
    while data := await theirs.recv(1 << 16):
        received += data
    assert received == b"half and the rest"


async def test_the_connection_gets_its_own_send_back_after_each_exchange(
    sim_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing of Tributary's stays on a connection (Hypercorn's connections are freed by
    the cycle collector, which would find it there)."""
    protocols: list[Any] = []
    find = direct_send.h11_protocol

    def record(send: Any) -> Any:
        protocol = find(send)
        protocols.append(protocol)
        return protocol

    monkeypatch.setattr(direct_send, "h11_protocol", record)
    client = await RawClient.connect(sim_server.url)
    try:
        for text in ("one", "two"):
            _, body = await client.post("/generate", stream_body(text=text))
            check_stream(body)
    finally:
        client.close()
    assert len(protocols) == 2 and protocols[0] is protocols[1]  # one keep-alive connection
    with trio.fail_after(5):
        while isinstance(protocols[0].send, direct_send.DirectWriter):
            await trio.sleep(0.01)  # the handler's last moments follow the response
    assert protocols[0].send.__func__ is TCPServer.protocol_send


#: A Hypercorn whose internals moved: the modules DirectSend reaches into cannot be imported.
MOVED_INTERNALS = """
import logging
import hypercorn.protocol.http_stream, hypercorn.trio.tcp_server
del hypercorn.protocol.http_stream.HTTPStream  # "from ... import HTTPStream" now fails
del hypercorn.trio.tcp_server.TCPServer
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
import trio
from tributary.app import ServerSettings, create_app
from tributary.app.http import direct_send
from tributary.engine import EngineConfig, open_engine

async def main():
    config = EngineConfig(runner="sim", context_length=256)
    async with open_engine(config) as engine:
        client = create_app(engine, ServerSettings()).test_client()
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        response = await client.post("/generate", json=body)
        print("status", response.status_code, "supported", direct_send.SUPPORTED)

trio.run(main)
"""


def test_a_hypercorn_that_moved_its_internals_still_imports_and_serves_with_a_warning() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", MOVED_INTERNALS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "status 200 supported False" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if "fast write path is off" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING"), done.stderr[-2000:]
