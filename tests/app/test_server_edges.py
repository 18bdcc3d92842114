"""Server edges any client can reach without the API key: each
test sends the attack, bounded in size and time over loopback, and asserts what an operator
or another client would notice: a fixed /metrics, a quiet log, an engine not flooded by
health probes, a smuggled request never answered."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import trio
from apphelpers import Server, greedy, host_port, running_server, server_settings, sim_config
from prometheus_client.parser import text_string_to_metric_families

from tributary import app, engine
from tributary.engine import EngineConfig, SamplingParams
from tributary.engine.runners.sim import SimRunner
from tributary.testing import DEFAULT_SIM_LATENCY, AppClient

KEY = {"Authorization": "Bearer sekrit"}

# -- item 5: /metrics stays the same size whatever methods and paths clients invent ----------


def http_series(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """The (name, labels) of every HTTP counter series in a /metrics body."""
    return {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in text_string_to_metric_families(text)
        if family.name.startswith("sglang:http_")
        for sample in family.samples
    }


async def send_junk(client: AppClient, start: int, count: int) -> None:
    """`count` requests, each with a method and a path no client sent before (100-byte
    method names: h11 takes any token up to its 16 KiB header limit)."""
    for i in range(start, start + count):
        method = f"M{i:04d}".ljust(100, "X")
        assert (await client.request(method, f"/junk/{i}")).status == 401
        assert (await client.get(f"/no/such/{i}")).status == 401


async def test_metrics_series_stay_fixed_whatever_methods_and_paths_clients_send(
    tributary_engine: engine.Engine,
) -> None:
    client = AppClient(app.create_app(tributary_engine, app.ServerSettings(api_key="sekrit")))
    await send_junk(client, 0, 5)
    first = (await client.get("/metrics", headers=KEY)).text
    await send_junk(client, 5, 400)
    second = (await client.get("/metrics", headers=KEY)).text
    # 800 more refused requests: not one new series, and only counter digits grew.
    assert http_series(second) == http_series(first) | {
        ("sglang:http_requests_total", (("endpoint", "/metrics"), ("method", "GET"),
                                        ("model_name", "sim"))),
        ("sglang:http_responses_total", (("endpoint", "/metrics"), ("method", "GET"),
                                         ("model_name", "sim"), ("status_code", "200"))),
    }  # fmt: skip
    assert len(second) - len(first) < 300
    labels = {dict(labels)["method"] for _, labels in http_series(second)}
    assert labels == {"other", "GET"}
    endpoints = {dict(labels)["endpoint"] for _, labels in http_series(second)}
    assert endpoints == {"unmatched", "/metrics"}


async def test_metrics_keep_the_usual_methods_by_name(tributary_engine: engine.Engine) -> None:
    client = AppClient(app.create_app(tributary_engine))
    usual = {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"}
    for method in usual:
        await client.request(method, "/health")
    methods = {
        dict(labels)["method"]
        for name, labels in http_series((await client.get("/metrics")).text)
        if dict(labels)["endpoint"] in ("/health", "unmatched")
    }
    assert methods == usual


# -- items 11 and 13: over a real socket -------------------------------------------------------


async def exchange_raw(url: str, data: bytes, *, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Send `data` on a new connection; read until the server closes it or `timeout` passes.
    (everything received, whether the server closed the connection)."""
    stream = await trio.open_tcp_stream(*host_port(url))
    received = bytearray()
    closed = False
    async with stream:
        await stream.send_all(data)
        with trio.move_on_after(timeout):
            while chunk := await stream.receive_some(1 << 16):
                received += chunk
            closed = True
    return bytes(received), closed


def upgrade(path: bytes, *, key: bool) -> bytes:
    request = (
        b"GET %b HTTP/1.1\r\nHost: test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" % path
    )
    request += b"Sec-WebSocket-Version: 13\r\n"
    if key:
        request += b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    return request + b"\r\n"


@pytest.fixture
async def keyed_server() -> Any:
    async with running_server(sim_config(), server_settings(api_key="sekrit")) as server:
        yield server


@pytest.mark.parametrize("path", [b"/generate", b"/v1/chat/completions", b"/nowhere"])
async def test_websocket_upgrade_is_refused_with_a_403_and_nothing_logged(
    keyed_server: Server, caplog: pytest.LogCaptureFixture, path: bytes
) -> None:
    caplog.set_level(logging.DEBUG)
    reply, closed = await exchange_raw(keyed_server.url, upgrade(path, key=True))
    assert reply.startswith(b"HTTP/1.1 403 "), reply[:100]
    assert closed
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_websocket_upgrade_without_its_key_gets_hypercorns_400_and_nothing_logged(
    keyed_server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Without Sec-WebSocket-Key, Hypercorn answers the handshake itself (the app never sees
    it). It keeps that connection open until the client closes it (docs/reliability.md,
    "Server edges"), so this reads only the answer."""
    caplog.set_level(logging.DEBUG)
    reply, _ = await exchange_raw(keyed_server.url, upgrade(b"/generate", key=False), timeout=1)
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:100]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


SMUGGLED = b"GET /get_model_info HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer sekrit\r\n\r\n"


@pytest.mark.parametrize("path", [b"/generate", b"/v1/completions"])
async def test_content_length_with_transfer_encoding_is_a_400_and_the_connection_closes(
    keyed_server: Server, path: bytes
) -> None:
    """A proxy that trusts Content-Length forwards the second request as this one's body; h11
    follows Transfer-Encoding and would read it as a request of its own."""
    chunked = b"0\r\n\r\n"
    request = (
        b"POST %b HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer sekrit\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" % (path, len(chunked) + len(SMUGGLED))
    )
    reply, closed = await exchange_raw(keyed_server.url, request + chunked + SMUGGLED)
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
    assert reply.count(b"HTTP/1.1 ") == 1  # the smuggled request was never answered
    assert closed
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"\r\nconnection: close\r\n" in head.lower() + b"\r\n"
    error = json.loads(body)["error"]
    assert "Content-Length and Transfer-Encoding" in error["message"]
    if path.startswith(b"/v1/"):
        assert error["type"] == "invalid_request_error"
    else:
        assert error["code"] == 400


async def test_a_plain_chunked_request_still_works(keyed_server: Server) -> None:
    body = json.dumps({"text": "hi", "sampling_params": greedy(2)}).encode()
    request = (
        b"POST /generate HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer sekrit\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n"
        b"\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    )
    reply, closed = await exchange_raw(keyed_server.url, request)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
    assert closed


# -- item 12: a /health_generate flood puts one probe in the engine --------------------------


class ProbeCountingRunner(SimRunner):
    """Counts the health probes (max_new_tokens 1) holding a slot, and the most at once."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(context_length=config.context_length or 8192, latency=config.sim_latency)
        self.probes: set[int] = set()
        self.most_probes = 0
        self.total_probes = 0

    def open_sequence(self, seq_id: int, params: SamplingParams) -> None:
        super().open_sequence(seq_id, params)
        if params.max_new_tokens == 1:
            self.probes.add(seq_id)
            self.total_probes += 1
            self.most_probes = max(self.most_probes, len(self.probes))

    def close_sequence(self, seq_id: int) -> None:
        super().close_sequence(seq_id)
        self.probes.discard(seq_id)


FLOOD = 64
#: A short request, where waiting behind probes shows most (a few steps in all).
TOKENS = 2


async def test_a_health_generate_flood_puts_one_probe_in_the_engine_at_a_time(
    autojump_clock: trio.abc.Clock,
) -> None:
    config = sim_config(sim_latency=DEFAULT_SIM_LATENCY)
    runner = ProbeCountingRunner(config)
    async with engine.open_engine(config, runner=runner) as eng:
        client = AppClient(app.create_app(eng, app.ServerSettings(api_key="sekrit")))
        statuses: list[int] = []

        async def probe() -> None:
            statuses.append((await client.get("/health_generate")).status)

        async with trio.open_nursery() as nursery:
            for _ in range(FLOOD):
                nursery.start_soon(probe)
        assert statuses == [200] * FLOOD
        assert runner.most_probes == 1
        assert runner.total_probes < FLOOD // 4  # callers that came together shared a probe


async def generate_latency(client: AppClient) -> float:
    start = trio.current_time()
    body = {"text": "hello", "sampling_params": greedy(TOKENS)}
    reply = await client.post("/generate", body, headers=KEY)
    assert reply.status == 200 and reply.json()["meta_info"]["completion_tokens"] == TOKENS
    return trio.current_time() - start


async def test_a_keyed_clients_latency_under_a_health_generate_flood_stays_within_2x(
    autojump_clock: trio.abc.Clock,
) -> None:
    """FLOOD clients without a key call /health_generate back to back; a keyed client's short
    /generate must not queue behind their probes. (Virtual time: what is measured is the
    engine's share, not the HTTP layer's CPU. Each probe gives way as soon as anyone's token
    appears, so without coalescing the delay is about one progress poll: 2.9x here, 1.2x
    with it.)"""
    config = sim_config(sim_latency=DEFAULT_SIM_LATENCY)
    async with engine.open_engine(config) as eng:
        client = AppClient(app.create_app(eng, app.ServerSettings(api_key="sekrit")))
        baseline = await generate_latency(client)
        answered: list[int] = []
        async with trio.open_nursery() as nursery:

            async def flood() -> None:
                while True:
                    answered.append((await client.get("/health_generate")).status)

            for _ in range(FLOOD):
                nursery.start_soon(flood)
            await trio.sleep(0.05)  # the flood is under way
            flooded = await generate_latency(client)
            nursery.cancel_scope.cancel()
        assert answered and set(answered) == {200}
        assert flooded <= 2 * baseline, (flooded, baseline)
