"""The front under workers that fail it: a worker that dies of a request
(the request is not handed to the next worker), one that answers without end (bounded
reads, a 502), one that never answers (timeouts), client code in a relayed body (refused),
and error bodies that never name a worker's URL. The misbehaving workers are raw TCP
servers on loopback beside a real Tributary worker on the sim runner; every wait is
bounded."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from hypercorn.trio import serve
from remotehelpers import FAST, fake_worker_request, greedy, start_worker

from tributary import app, testing
from tributary.app.server import hypercorn_config
from tributary.engine import EngineConfig, open_engine
from tributary.engine.remote import RemoteConfig, RemoteEngine, open_remote_engine
from tributary.engine.remote.wire import AnswerTooLarge, SSEPayloads

# -- a worker on a raw socket ---------------------------------------------------------------

MODELS = {"object": "list", "data": [{"id": "fake", "object": "model"}]}
CHUNK = b"a" * 65536
FINAL_FRAME = {
    "text": "ok",
    "output_ids": [1],
    "meta_info": {
        "id": "x",
        "finish_reason": {"type": "length", "length": 1},
        "prompt_tokens": 1,
        "completion_tokens": 1,
        "cached_tokens": 0,
    },
}


async def read_request(stream: trio.SocketStream) -> tuple[str, bytes]:
    """The path and body of one HTTP/1.1 request (Content-Length bodies, as httpx sends)."""
    data = b""
    while b"\r\n\r\n" not in data:
        got = await stream.receive_some(65536)
        if not got:
            raise EOFError
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(body) < length:
        got = await stream.receive_some(65536)
        if not got:
            raise EOFError
        body += got
    return lines[0].split()[1], body


def head(status: int, content_type: str, length: int | None = None) -> bytes:
    size = f"content-length: {length}\r\n" if length is not None else "connection: close\r\n"
    return f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\n{size}\r\n".encode()


async def send_json(stream: trio.SocketStream, status: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    await stream.send_all(head(status, "application/json", len(body)) + body)


class RawWorker:
    """Answers its model's questions (`/v1/models`, `/get_model_info`; never, if
    `silent_info`) and does what `behaviour` names with every generation request, which it
    records in `seen` (path, body); `sent` counts the bytes of its endless answers."""

    def __init__(self, behaviour: str, *, silent_info: bool = False) -> None:
        self.behaviour = behaviour
        self.silent_info = silent_info
        self.seen: list[tuple[str, bytes]] = []
        self.sent = 0
        self.url = ""

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            path, body = await read_request(stream)
        except (EOFError, trio.BrokenResourceError):
            return
        if path in ("/v1/models", "/get_model_info", "/get_server_info"):
            if self.silent_info:
                await trio.sleep_forever()
            await send_json(stream, 200, MODELS if path == "/v1/models" else {"model_path": "f"})
            return
        if path in ("/health", "/abort_request"):
            await send_json(stream, 200, {})
            return
        self.seen.append((path, body))
        try:
            await getattr(self, self.behaviour)(stream, path)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the front stopped reading

    async def drop(self, stream: trio.SocketStream, path: str) -> None:
        """Has the whole request, then the connection closes without a byte: the worker
        died of it (llguidance crashing the process on a grammar)."""

    async def silent(self, stream: trio.SocketStream, path: str) -> None:
        await trio.sleep_forever()

    async def frame_then_silent(self, stream: trio.SocketStream, path: str) -> None:
        first = {**FINAL_FRAME, "meta_info": {**FINAL_FRAME["meta_info"], "finish_reason": None}}
        await stream.send_all(head(200, "text/event-stream") + sse(first))
        await trio.sleep_forever()

    async def endless(self, stream: trio.SocketStream, start: bytes) -> None:
        await stream.send_all(start)
        while True:
            await stream.send_all(CHUNK)
            self.sent += len(CHUNK)

    async def endless_json(self, stream: trio.SocketStream, path: str) -> None:
        await self.endless(stream, head(200, "application/json") + b'{"choices": "')

    async def endless_error(self, stream: trio.SocketStream, path: str) -> None:
        await self.endless(stream, head(400, "application/json") + b'{"error": "')

    async def endless_event(self, stream: trio.SocketStream, path: str) -> None:
        await self.endless(stream, head(200, "text/event-stream") + b'data: {"text": "')

    async def error_then_silent(self, stream: trio.SocketStream, path: str) -> None:
        await stream.send_all(head(400, "application/json", 100) + b'{"error": ')
        await trio.sleep_forever()

    async def echo(self, stream: trio.SocketStream, path: str) -> None:
        if path == "/generate":
            body = sse(FINAL_FRAME) + b"data: [DONE]\n\n"
            await stream.send_all(head(200, "text/event-stream", len(body)) + body)
        else:
            await send_json(stream, 200, {"object": "chat.completion", "echo": True})


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def remote_config(**options: Any) -> RemoteConfig:
    """A `RemoteConfig` with the options it has (so that this file also runs against a
    front without the newer ones, to see its tests fail there)."""
    names = {f.name for f in dataclasses.fields(RemoteConfig)}
    return RemoteConfig(**{k: v for k, v in options.items() if k in names})


@dataclasses.dataclass
class Front:
    engine: RemoteEngine
    url: str
    raw: RawWorker
    real: Any  # remotehelpers.Worker, or None


@asynccontextmanager
async def front_over(
    raw: RawWorker, *, kind: str = "sglang", real: bool = True, **options: Any
) -> AsyncIterator[Front]:
    """`raw` on loopback (worker 1) and, if `real`, a Tributary sim worker (worker 2), with
    a front over them: round robin (so the first request goes to `raw`), no health checks."""
    async with trio.open_nursery() as nursery, open_engine(EngineConfig(runner="sim")) as engine:
        listeners = await nursery.start(partial(trio.serve_tcp, raw.handle, 0, host="127.0.0.1"))
        raw.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        urls = [raw.url]
        worker = None
        if real:
            worker = await start_worker(nursery, engine)
            urls.append(worker.url)
        config = remote_config(
            workers=tuple((u, kind) for u in urls),
            **{
                "policy": "round_robin",
                "health_check_interval": 0,
                "health_check_timeout": 0.5,
                "retry_backoff": 0.01,
                "abort_timeout": 0.3,
                **options,
            },
        )
        async with (
            open_remote_engine(config) as front,
            app.open_http_server(front, testing.server_settings()) as front_urls,
        ):
            yield Front(front, front_urls[0], raw, worker)
        nursery.cancel_scope.cancel()


async def requests_seen(client: httpx.AsyncClient, worker_url: str, endpoint: str) -> float:
    """How many requests a Tributary worker has answered on `endpoint` (its /metrics)."""
    text = (await client.get(f"{worker_url}/metrics")).text
    pattern = rf'^sglang:http_requests_total{{[^}}]*endpoint="{re.escape(endpoint)}"[^}}]*}} (\S+)'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def assert_names_no_worker(text: str, *urls: str) -> None:
    """A client's error body names no worker URL, host or port."""
    for url in urls:
        host_port = url.split("://", 1)[1]
        assert url not in text and host_port not in text, text
    assert "127.0.0.1" not in text, text


async def upstream_failures(client: httpx.AsyncClient, front: str) -> dict[str, float]:
    text = (await client.get(f"{front}/metrics")).text
    found = re.findall(
        r'^tributary:front_upstream_failures_total{reason="(\w+)"} (\S+)', text, re.M
    )
    return {reason: float(value) for reason, value in found}


BODY = {"text": "a poison request", "sampling_params": greedy(4)}


# -- a request that kills its worker is not handed to the next one --------------------------


async def test_a_worker_that_drops_a_request_it_had_does_not_pass_it_on() -> None:
    async with (
        front_over(RawWorker("drop"), breaker_failure_threshold=2) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        real = front.real.url
        with trio.fail_after(10):
            unary = await client.post(f"{front.url}/generate", json=BODY)
        assert unary.status_code == 502, unary.text
        message = unary.json()["error"]["message"]
        assert "Worker 1 dropped the connection" in message and "not retried" in message
        assert_names_no_worker(unary.text, front.raw.url, real)
        assert await requests_seen(client, real, "/generate") == 0  # never passed on
        # Round robin: the next one goes to the real worker, and is served.
        ok = await client.post(f"{front.url}/generate", json=BODY)
        assert ok.status_code == 200
        assert await requests_seen(client, real, "/generate") == 1
        # A stream: the error event, then [DONE]; still not passed on.
        streamed = await client.post(f"{front.url}/generate", json={**BODY, "stream": True})
        events = testing.parse_sse(streamed.text)
        assert streamed.status_code == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == 502
        assert_names_no_worker(streamed.text, front.raw.url, real)
        assert await requests_seen(client, real, "/generate") == 1
        assert len(front.raw.seen) == 2
        assert await upstream_failures(client, front.url) == {
            "dropped": 2,
            "timeout": 0,
            "too_large": 0,
        }
        # Two failures in a row opened worker 1's breaker: the rest of the fleet serves.
        for _ in range(3):
            assert (await client.post(f"{front.url}/generate", json=BODY)).status_code == 200
        assert len(front.raw.seen) == 2


async def test_a_worker_that_dies_of_a_request_does_not_pass_it_on() -> None:
    """A worker whose whole server goes as a request arrives (as a process that crashes):
    the request fails with a 502; later requests find its port closed, which is a
    failure before sending and is retried on the live worker, as ever."""
    server: dict[str, trio.CancelScope] = {}
    arrived: list[str] = []

    async def dying(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raw = await fake_worker_request(scope, receive, send)
        if raw is None:
            return
        if scope["path"] != "/generate":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        arrived.append(scope["path"])
        server["scope"].cancel()  # the process dies: every connection is cut
        await trio.sleep_forever()

    async def run(*, task_status: trio.TaskStatus[Any]) -> None:
        with trio.CancelScope() as scope:
            server["scope"] = scope
            await serve(dying, hypercorn_config(testing.server_settings()), task_status=task_status)

    async with (
        trio.open_nursery() as nursery,
        open_engine(EngineConfig(runner="sim", sim_latency=FAST)) as engine,
        httpx.AsyncClient(timeout=30) as client,
    ):
        binds = await nursery.start(run)
        live = await start_worker(nursery, engine)
        config = remote_config(
            workers=((binds[0], "sglang"), (live.url, "sglang")),
            policy="round_robin",
            health_check_interval=0,
            retry_backoff=0.01,
            abort_timeout=0.3,
        )
        async with (
            open_remote_engine(config) as front,
            app.open_http_server(front, testing.server_settings()) as urls,
        ):
            with trio.fail_after(10):
                answer = await client.post(f"{urls[0]}/generate", json=BODY)
            assert answer.status_code == 502, answer.text
            assert_names_no_worker(answer.text, binds[0], live.url)
            assert arrived == ["/generate"]
            assert await requests_seen(client, live.url, "/generate") == 0
            for _ in range(3):  # its port is closed now: refused, retried, served
                again = await client.post(f"{urls[0]}/generate", json=BODY)
                assert again.status_code == 200, again.text
            assert await requests_seen(client, live.url, "/generate") == 3
            assert front.upstream_failures["dropped"] == 1
        nursery.cancel_scope.cancel()


async def test_a_relayed_chat_that_kills_its_worker_is_not_passed_on() -> None:
    async with (
        front_over(RawWorker("drop"), kind="openai") as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        chat = {"messages": [{"role": "user", "content": "poison"}], "max_tokens": 2}
        with trio.fail_after(10):
            answer = await client.post(f"{front.url}/v1/chat/completions", json=chat)
        assert answer.status_code == 502, answer.text
        assert "dropped the connection" in answer.json()["error"]["message"]
        assert_names_no_worker(answer.text, front.raw.url, front.real.url)
        assert await requests_seen(client, front.real.url, "/v1/chat/completions") == 0
        assert front.engine.upstream_failures["dropped"] == 1


# -- bounded reads of what a worker sends ---------------------------------------------------


async def test_an_endless_unary_answer_is_a_502_and_is_read_no_further() -> None:
    limit = 1 << 20
    async with (
        front_over(RawWorker("endless_json"), kind="openai", max_answer_bytes=limit) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        started = time.monotonic()
        with trio.fail_after(20):
            answer = await client.post(f"{front.url}/v1/chat/completions", json=chat)
        assert answer.status_code == 502, answer.text[:300]
        assert "limit of 1 MiB" in answer.json()["error"]["message"]
        assert_names_no_worker(answer.text, front.raw.url, front.real.url)
        assert time.monotonic() - started < 10
        await trio.sleep(0.2)  # the worker's last send fails once the front has closed
        # What the front read is the limit; the rest is what loopback's buffers held.
        assert front.raw.sent < limit + (32 << 20)
        assert await requests_seen(client, front.real.url, "/v1/chat/completions") == 0
        assert front.engine.upstream_failures["too_large"] == 1


async def test_an_endless_error_body_is_cut_and_its_status_kept() -> None:
    async with (
        front_over(RawWorker("endless_error"), max_error_bytes=1 << 16) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        with trio.fail_after(20):
            answer = await client.post(f"{front.url}/generate", json=BODY)
        assert answer.status_code == 400  # the worker's: the client's input, not retried
        assert len(answer.text) < 4096
        await trio.sleep(0.2)
        assert front.raw.sent < (1 << 16) + (32 << 20)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_event_that_never_ends_is_a_502(stream: bool) -> None:
    limit = 1 << 20
    async with (
        front_over(RawWorker("endless_event"), max_event_bytes=limit) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        with trio.fail_after(20):
            answer = await client.post(f"{front.url}/generate", json={**BODY, "stream": stream})
        error = testing.parse_sse(answer.text)[-2] if stream else answer.json()
        assert error["error"]["code"] == 502
        assert "one event of its stream passed the front's limit of 1 MiB" in answer.text
        assert_names_no_worker(answer.text, front.raw.url, front.real.url)
        await trio.sleep(0.2)
        assert front.raw.sent < limit + (32 << 20)
        assert await requests_seen(client, front.real.url, "/generate") == 0


def test_sse_reading_is_linear_in_an_unfinished_event() -> None:
    """An event that does not end was copied whole on every chunk (quadratic: 16 MiB in 4
    KiB chunks is 4,096 copies of up to 16 MiB, 32 GiB in all)."""
    payloads = SSEPayloads(max_event_bytes=32 << 20)
    chunk = b"x" * 4096
    started = time.perf_counter()
    assert payloads.feed(b'data: {"text": "') == []
    for _ in range(4096):
        assert payloads.feed(chunk) == []
    assert payloads.feed(b'"}\n\ndata: [DONE]\n\n') == [
        b'{"text": "' + chunk * 4096 + b'"}',
        b"[DONE]",
    ]
    assert time.perf_counter() - started < 5  # ~0.1 s; quadratic, minutes
    over = SSEPayloads(max_event_bytes=1 << 20)
    with pytest.raises(AnswerTooLarge):
        for _ in range(300):
            over.feed(chunk)


# -- a worker that never answers ------------------------------------------------------------


async def test_a_worker_that_never_names_its_model_is_given_up_and_skipped() -> None:
    async with (
        front_over(
            RawWorker("echo", silent_info=True),
            kind="openai",
            info_timeout=0.3,
            breaker_failure_threshold=2,
        ) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        with trio.fail_after(10):
            for _ in range(3):  # worker 1 first: its /v1/models never answers
                answer = await client.post(f"{front.url}/generate", json=BODY)
                assert answer.status_code == 200, answer.text
        silent = front.engine.fleet.workers[0]
        assert silent.errors_total == 2 and silent.breaker.state == "open"
        assert front.raw.seen == []  # never sent a request it could not name a model for


async def test_a_lone_worker_that_never_names_its_model_is_a_503_not_a_hang() -> None:
    async with (
        front_over(
            RawWorker("echo", silent_info=True), kind="openai", real=False, info_timeout=0.3
        ) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        with trio.fail_after(10):
            answer = await client.post(f"{front.url}/generate", json=BODY)
        assert answer.status_code == 503
        assert "/v1/models" in answer.json()["error"]["message"]
        assert_names_no_worker(answer.text, front.raw.url)
        with trio.fail_after(10):
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            relayed = await client.post(f"{front.url}/v1/chat/completions", json=chat)
        assert relayed.status_code == 503
        assert_names_no_worker(relayed.text, front.raw.url)


@pytest.mark.parametrize("behaviour", ["silent", "frame_then_silent"])
async def test_a_silent_worker_is_a_504_and_the_request_is_not_passed_on(behaviour: str) -> None:
    async with (
        front_over(RawWorker(behaviour), worker_timeout=0.5) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        started = time.monotonic()
        with trio.fail_after(10):
            answer = await client.post(f"{front.url}/generate", json={**BODY, "stream": True})
        assert time.monotonic() - started < 5
        events = testing.parse_sse(answer.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 504
        assert "sent nothing for 0.5 s" in events[-2]["error"]["message"]
        if behaviour == "frame_then_silent":
            assert events[0]["text"] == "ok"
        assert_names_no_worker(answer.text, front.raw.url, front.real.url)
        assert await requests_seen(client, front.real.url, "/generate") == 0
        assert front.engine.upstream_failures["timeout"] == 1
        assert front.engine.fleet.workers[0].errors_total == 1  # counted against it


async def test_a_silent_worker_behind_a_chat_relay_is_a_504() -> None:
    async with (
        front_over(RawWorker("silent"), kind="openai", worker_timeout=0.5) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        with trio.fail_after(10):
            answer = await client.post(f"{front.url}/v1/chat/completions", json=chat)
        assert answer.status_code == 504, answer.text
        assert_names_no_worker(answer.text, front.raw.url, front.real.url)
        assert await requests_seen(client, front.real.url, "/v1/chat/completions") == 0


# -- client code is not relayed unless the front says so ------------------------------------


@pytest.mark.parametrize("field", ["custom_logit_processor", "logits_processors"])
async def test_a_chat_with_a_custom_logit_processor_is_refused_at_the_front(field: str) -> None:
    value: Any = "gASV...pickled" if field == "custom_logit_processor" else ["mod.Cls"]
    chat = {"messages": [{"role": "user", "content": "hi"}], field: value}
    async with (
        front_over(RawWorker("echo"), kind="openai", real=False) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        refused = await client.post(f"{front.url}/v1/chat/completions", json=chat)
        assert refused.status_code == 501, refused.text
        assert "--enable-custom-logit-processor" in refused.json()["error"]["message"]
        generate = {**BODY, "custom_logit_processor": "gASV...pickled"}
        assert (await client.post(f"{front.url}/generate", json=generate)).status_code == 501
        assert front.raw.seen == []
        # A null is no processor.
        plain = await client.post(f"{front.url}/v1/chat/completions", json={**chat, field: None})
        assert plain.status_code == 200


async def test_a_front_started_to_forward_custom_logit_processors_forwards_them() -> None:
    raw = RawWorker("echo")
    async with (
        front_over(raw, real=False, enable_custom_logit_processor=True) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        chat = {"messages": [{"role": "user", "content": "hi"}], "custom_logit_processor": "p"}
        assert (await client.post(f"{front.url}/v1/chat/completions", json=chat)).status_code == 200
        generate = {**BODY, "custom_logit_processor": "p"}
        assert (await client.post(f"{front.url}/generate", json=generate)).status_code == 200
        bodies = [json.loads(body) for _, body in raw.seen]
        assert [b["custom_logit_processor"] for b in bodies] == ["p", "p"]


# -- worker management is the admin's, and so are worker URLs -------------------------------


@pytest.mark.parametrize("keys", [{}, {"api_key": "user"}])
async def test_without_an_admin_key_worker_management_is_off(keys: dict[str, str]) -> None:
    user = {"Authorization": "Bearer user"} if keys else {}
    config = remote_config(workers=(("http://127.0.0.1:9", "sglang"),), health_check_interval=0)
    async with (
        open_remote_engine(config) as front,
        app.open_http_server(front, testing.server_settings(**keys)) as urls,
        httpx.AsyncClient(timeout=30) as client,
    ):
        attacker = {"url": "http://attacker.example:80"}
        added = await client.post(f"{urls[0]}/add_worker", json=attacker, headers=user)
        assert added.status_code == 403 and "--admin-api-key" in added.json()["error"]["message"]
        assert [w.url for w in front.fleet.workers] == ["http://127.0.0.1:9"]
        listed = await client.get(f"{urls[0]}/list_workers", headers=user)
        assert listed.status_code == 403 and "127.0.0.1" not in listed.text
        removed = await client.post(
            f"{urls[0]}/remove_worker", params={"url": "http://127.0.0.1:9"}, headers=user
        )
        assert removed.status_code == 403 and len(front.fleet.workers) == 1
        # Nor does the server's own description name them.
        info = await client.get(f"{urls[0]}/get_server_info", headers=user)
        assert info.status_code == 200 and "127.0.0.1:9" not in info.text


async def test_with_an_admin_key_only_it_manages_workers() -> None:
    config = remote_config(workers=(("http://127.0.0.1:9", "sglang"),), health_check_interval=0)
    settings = testing.server_settings(api_key="user", admin_api_key="boss")
    user, boss = {"Authorization": "Bearer user"}, {"Authorization": "Bearer boss"}
    async with (
        open_remote_engine(config) as front,
        app.open_http_server(front, settings) as urls,
        httpx.AsyncClient(timeout=30) as client,
    ):
        attacker = {"url": "http://attacker.example:80"}
        for headers in (user, {}):
            added = await client.post(f"{urls[0]}/add_worker", json=attacker, headers=headers)
            assert added.status_code == 401
            assert (await client.get(f"{urls[0]}/list_workers", headers=headers)).status_code == 401
        assert len(front.fleet.workers) == 1
        added = await client.post(f"{urls[0]}/add_worker", json=attacker, headers=boss)
        assert added.status_code == 200 and added.json()["id"] == 2
        # The admin's list names the URLs and the numbers client errors use.
        listed = (await client.get(f"{urls[0]}/list_workers", headers=boss)).json()["workers"]
        assert [(w["id"], w["url"]) for w in listed] == [
            (1, "http://127.0.0.1:9"),
            (2, "http://attacker.example:80"),
        ]


async def test_errors_of_unreachable_and_removed_workers_name_no_url() -> None:
    """Before: `Worker http://10.0.0.5:8000 failed: [Errno 111] ... ('10.0.0.5', 8000)`."""
    async with (
        front_over(RawWorker("silent"), real=True, worker_timeout=5) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        dead = f"http://127.0.0.1:{_free_port()}"
        front.engine.add_worker(dead)
        front.engine.remove_worker(front.real.url)
        # Removed while it had the request, before answering: a 503, not passed on.
        answer = await removed_while_held(front, client)
        assert answer.status_code == 503, answer.text
        assert_names_no_worker(answer.text, front.raw.url, front.real.url, dead)
        refused = await client.post(f"{front.url}/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503
        assert_names_no_worker(refused.text, front.raw.url, front.real.url, dead)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- a connection that breaks while the request is sent: retried, as ever -------------------


class ResetWhileSending(RawWorker):
    """Reads a generation request's head only and resets the connection (after `delay`
    seconds) while the body is still coming: it never had the request. A request with a
    body under `small` bytes is read whole and dropped instead (`drop`)."""

    def __init__(self, *, delay: float = 0.0, small: int = 0) -> None:
        super().__init__("drop")
        self.delay = delay
        self.small = small

    async def handle(self, stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            got = await stream.receive_some(65536)
            if not got:
                return
            data += got
        head_text = data.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
        found = re.search(r"content-length: *(\d+)", head_text)
        length = int(found[1]) if found else 0
        path = head_text.split()[1]
        if path in ("/v1/models", "/get_model_info", "/get_server_info", "/health") or (
            length < self.small
        ):
            # Small bodies: as a RawWorker (what the head brought is the start of the body).
            body = data.partition(b"\r\n\r\n")[2]
            while len(body) < length:
                got = await stream.receive_some(65536)
                if not got:
                    return
                body += got
            if path == "/v1/models":
                await send_json(stream, 200, MODELS)
            elif path.startswith("/get_"):
                await send_json(stream, 200, {"model_path": "f"})
            elif path == "/health":
                await send_json(stream, 200, {})
            else:
                self.seen.append((path, body))  # then dropped, as `drop`
            return
        self.seen.append((path, b""))
        await trio.sleep(self.delay)
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()


@asynccontextmanager
async def front_over_raw(*raws: RawWorker, **options: Any) -> AsyncIterator[str]:
    """A front (its URL) over `raws` on loopback, workers 1, 2, ... in that order."""
    async with trio.open_nursery() as nursery:
        for raw in raws:
            listeners = await nursery.start(
                partial(trio.serve_tcp, raw.handle, 0, host="127.0.0.1")
            )
            raw.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        config = remote_config(
            workers=tuple((raw.url, "sglang") for raw in raws),
            **{
                "policy": "round_robin",
                "health_check_interval": 0,
                "retry_backoff": 0.01,
                "abort_timeout": 0.3,
                **options,
            },
        )
        async with (
            open_remote_engine(config) as front,
            app.open_http_server(front, testing.server_settings()) as urls,
        ):
            yield urls[0]
        nursery.cancel_scope.cancel()


async def test_a_connection_reset_while_the_body_is_sent_is_retried() -> None:
    """httpcore swallows the error of writing the body and reads the answer, which fails
    as a dropped connection would after the request: the front must tell the two apart (the
    body was not written whole) and retry on another worker, as for any failure to send."""
    reset, live = ResetWhileSending(), RawWorker("echo")
    async with front_over_raw(reset, live) as front, httpx.AsyncClient(timeout=30) as client:
        body = {"text": "x" * (3 << 20), "sampling_params": greedy(2)}
        with trio.fail_after(20):
            answer = await client.post(f"{front}/generate", json=body)
        assert answer.status_code == 200, answer.text[:300]
        assert answer.json()["text"] == "ok"  # worker 2's answer
        assert len(reset.seen) == 1 and len(live.seen) == 1
        assert await upstream_failures(client, front) == {
            "dropped": 0,
            "timeout": 0,
            "too_large": 0,
        }


# -- one client request, one worker (a poison batch kills one worker) -----------------------

POISON_BATCHES = {
    "batch": {"text": ["alpha poison", "zulu poison"], "sampling_params": greedy(4)},
    "n": {"text": "poison", "sampling_params": {**greedy(4), "n": 2, "temperature": 1.0}},
}


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two", "cache_aware"])
@pytest.mark.parametrize("shape", sorted(POISON_BATCHES))
async def test_the_items_of_one_request_go_to_one_worker(policy: str, shape: str) -> None:
    """SGLang's gateway sends a batch body to one worker whole; the front sends a request's
    items to the worker its first item got, so a poison batch reaches one worker, not one
    worker per item (nor a retry elsewhere)."""
    first, second = RawWorker("drop"), RawWorker("drop")
    async with (
        front_over_raw(first, second, policy=policy) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        for _ in range(3):  # round robin, power of two: each a chance to part them
            first.seen.clear()
            second.seen.clear()
            with trio.fail_after(10):
                answer = await client.post(f"{front}/generate", json=POISON_BATCHES[shape])
            assert answer.status_code in (200, 502), answer.text
            items = answer.json()
            assert [item["error"]["code"] for item in items] == [502, 502]
            assert sorted([len(first.seen), len(second.seen)]) == [0, 2]


async def test_a_sibling_of_a_lost_item_is_not_sent_elsewhere() -> None:
    """Item 1 is lost by worker 1 (dropped after it had it); item 2's connection to worker
    1 breaks before it was sent, which alone would be a retry on worker 2: instead it ends
    with item 1's error (its worker died of this request, and of it worker 2 would too)."""
    mixed, live = ResetWhileSending(delay=0.5, small=1 << 20), RawWorker("echo")
    async with front_over_raw(mixed, live) as front, httpx.AsyncClient(timeout=30) as client:
        body = {"text": ["alpha poison", "z" * (3 << 20)], "sampling_params": greedy(2)}
        with trio.fail_after(20):
            answer = await client.post(f"{front}/generate", json=body)
        items = answer.json()
        assert [item["error"]["code"] for item in items] == [502, 502], answer.text[:300]
        assert items[0]["error"]["message"] == items[1]["error"]["message"]
        assert "Worker 1 dropped the connection" in items[1]["error"]["message"]
        assert [path for path, _ in mixed.seen if path == "/generate"] == ["/generate"] * 2
        assert live.seen == []


# -- a removed worker that had the request: not passed on -----------------------------------


async def removed_while_held(front: Front, client: httpx.AsyncClient) -> httpx.Response:
    """The answer to a /generate that the front's silent worker had when it was removed."""
    results: list[httpx.Response] = []

    async def held() -> None:
        results.append(await client.post(f"{front.url}/generate", json=BODY))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(held)
        with trio.fail_after(10):
            while not front.raw.seen:
                await trio.sleep(0.01)
        front.engine.remove_worker(front.raw.url)
    (answer,) = results
    return answer


async def test_a_request_a_removed_worker_had_is_not_passed_on() -> None:
    async with (
        front_over(RawWorker("silent"), worker_timeout=30) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        answer = await removed_while_held(front, client)
        assert answer.status_code == 503, answer.text
        message = answer.json()["error"]["message"]
        assert "Worker 1 was removed from the fleet while it had the request" in message
        assert await requests_seen(client, front.real.url, "/generate") == 0


# -- a worker's big error answer to a relayed chat: cut, its status kept --------------------


class BigError(RawWorker):
    async def big(self, stream: trio.SocketStream, path: str) -> None:
        body = b'{"error": {"message": "' + b"a" * (3 << 20) + b'", "code": 400}}'
        await stream.send_all(head(400, "application/json", len(body)) + body)


async def test_a_big_error_answer_to_a_relayed_chat_is_cut_and_keeps_its_status() -> None:
    async with (
        front_over(BigError("big"), kind="openai", real=False, max_answer_bytes=1 << 20) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        with trio.fail_after(20):
            answer = await client.post(f"{front.url}/v1/chat/completions", json=chat)
        assert answer.status_code == 400, answer.text[:300]  # the worker's: not a 502
        assert len(answer.content) < 4096
        assert answer.json()["error"]["message"].startswith('{"error": {"message": "aaa')
        assert front.engine.upstream_failures["too_large"] == 0
        assert front.engine.fleet.workers[0].errors_total == 0


async def test_an_error_body_that_stops_coming_says_the_status_came() -> None:
    async with (
        front_over(RawWorker("error_then_silent"), real=False, worker_timeout=0.5) as front,
        httpx.AsyncClient(timeout=30) as client,
    ):
        with trio.fail_after(10):
            answer = await client.post(f"{front.url}/generate", json=BODY)
        assert answer.status_code == 504, answer.text
        message = answer.json()["error"]["message"]
        assert "after answering 400, in the middle of its body" in message, message
        assert "before answering" not in message
