"""Helpers for the HTTP front end tests: sim engines, real Hypercorn servers on port 0, a
scripted engine for outputs the sim runner cannot produce, and SSE parsing.

Engines and servers come from Tributary's pytest plugin (`tributary.testing`); what is here
are the suite's defaults on top of it (a fast sim model, `Server.eng`). Test modules import
these with `from apphelpers import ...` (the fixtures are re-exported by conftest.py, which
puts this directory on sys.path).
"""

from __future__ import annotations

import dataclasses
import json
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from tributary import app, engine, testing
from tributary.engine import (
    EngineConfig,
    EngineStats,
    GenerateRequest,
    ModelInfo,
    Output,
    SimLatency,
)
from tributary.engine.runners.sim import SimRunner

#: A fast sim model for wire tests: about 2.5 ms per decode step.
FAST = SimLatency(step_base=0.002, decode_per_seq=0.0005, prefill_per_token=0.00005)

#: meta_info keys every /generate response carries, in SGLang's order (before
#: e2e_latency, which only terminal outputs add).
META_KEYS = [
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
]


def sim_config(**overrides: Any) -> EngineConfig:
    """The plugin's `sim_config` with the FAST latency model."""
    return testing.sim_config(**{"sim_latency": FAST, **overrides})


#: ChatML, so that /v1/chat/completions runs on the sim model (which has no template).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_sim_runner(config: EngineConfig) -> SimRunner:
    """A sim runner for `config` whose model has a chat template (`CHAT_TEMPLATE`); pass it
    to `open_engine(config, runner=...)`."""
    runner = SimRunner(context_length=config.context_length or 8192, latency=config.sim_latency)
    runner.info = dataclasses.replace(runner.info, chat_template=CHAT_TEMPLATE)
    return runner


#: Port 0 and a 1 s graceful shutdown, with overrides.
server_settings = testing.server_settings


@dataclasses.dataclass
class Server:
    eng: engine.Engine
    url: str


@asynccontextmanager
async def running_server(
    config: EngineConfig | None = None, settings: app.ServerSettings | None = None
) -> AsyncIterator[Server]:
    """An engine plus a real Hypercorn on an ephemeral port, shut down gracefully on exit."""
    async with testing.open_server(config or sim_config(), settings) as server:
        yield Server(server.engine, server.url)


@asynccontextmanager
async def two_stream_modes(config: EngineConfig) -> AsyncIterator[tuple[Server, str]]:
    """One engine behind two servers: cumulative streaming (the Server) and incremental (the
    second URL)."""
    async with running_server(config) as server:
        incremental = app.create_app(server.eng, server_settings(incremental_streaming_output=True))
        async with app.open_http_server(incremental, server_settings()) as urls:
            yield server, urls[0]


@pytest.fixture
def sim_server(tributary_server: testing.RunningServer) -> Server:
    """The plugin's real server, on the engine of `tributary_engine_config` (conftest.py)."""
    return Server(tributary_server.engine, tributary_server.url)


@pytest.fixture
def client(tributary_http_client: httpx.AsyncClient) -> httpx.AsyncClient:
    return tributary_http_client


def parse_sse(body: str) -> list[Any]:
    """SSE body -> list of decoded `data:` payloads ("[DONE]" stays a string). Fails on
    anything that is not SGLang's exact framing."""
    assert body.endswith("\n\n"), body[-50:]
    events = []
    for block in body[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def host_port(url: str) -> tuple[str, int]:
    """`http://host:port` -> (host, port), for tests that open raw sockets."""
    host, _, port = url.removeprefix("http://").rpartition(":")
    return host, int(port)


async def raw_socket(url: str, *, receive_buffer: int | None = None) -> trio.socket.SocketType:
    """A Trio socket connected to `url`; `receive_buffer` sets SO_RCVBUF before connecting
    (the TCP window is agreed then)."""
    sock = trio.socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    await sock.connect(host_port(url))
    return sock


async def post_until_closed(
    url: str, body: bytes, *, version: bytes = b"1.1", path: bytes = b"/generate"
) -> bytes:
    """POST `body` (JSON) to `path` over a raw socket and read until the server closes the
    connection (an HTTP/1.0 exchange, or a response cut short): everything received."""
    sock = await raw_socket(url)
    received = bytearray()
    try:
        await sock.send(
            b"POST %b HTTP/%b\r\nhost: test\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (path, version, len(body), body)
        )
        with trio.fail_after(30):
            while data := await sock.recv(1 << 16):
                received += data
    finally:
        sock.close()
    return bytes(received)


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


async def wait_until(predicate: Callable[[], bool], *, timeout: float = 10.0) -> None:
    """Poll a test-side condition (the server under test never polls)."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.001)


# -- a scripted engine ------------------------------------------------------------------------

Script = Callable[[int, str], list[Output]]


class ScriptedEngine:
    """Stands in for `engine.Engine` where a test needs outputs the sim runner cannot make
    (an abort with a status code, a truncated channel, a precise backlog).

    `script(i, rid)` gives the items the i-th submitted request receives at once; the test can
    send more later through `senders[i]`, or close it to truncate the stream.
    """

    def __init__(self, script: Script | None = None) -> None:
        self.model_info = ModelInfo(
            name="scripted",
            path="scripted",
            context_length=4096,
            train_context_length=4096,
            vocab_size=259,
            eos_token_ids=frozenset({0, 2}),
            eos_token_id=0,
            bos_token_id=None,
            chat_template=None,
        )
        self.config = EngineConfig(runner="sim")
        self.capacity = self.config.max_running_requests + self.config.max_queued_requests
        self.script = script
        self.requests: list[GenerateRequest] = []
        self.senders: list[engine.OutputSender] = []
        self.aborted: list[str] = []

    async def prepare(self, items: Sequence[GenerateRequest]) -> list[GenerateRequest]:
        return list(items)  # nothing to tokenize or compile

    def submit(self, request: GenerateRequest) -> engine.RequestStream:
        i = len(self.requests)
        rid = request.rid or f"scripted-{i}"
        send, recv = engine.open_output_channel(rid)
        self.requests.append(request)
        self.senders.append(send)
        for item in self.script(i, rid) if self.script else []:
            send.send(item)
        return engine.RequestStream(
            rid=rid,
            prompt_tokens=3,
            receiver=recv,
            abort=lambda: self.aborted.append(rid),
            sender=send,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            running=0, waiting=0, kv_used_cells=0, kv_total_cells=8192, steps=0, generated_tokens=0
        )

    def slowest_recent_step(self) -> float:
        return 0.0

    def abort_waiting(self, **options: Any) -> int:
        return 0

    def abort(self, rid: str, **options: Any) -> int:
        return 0

    def abort_all(self, **options: Any) -> int:
        return 0
