"""Chat completions at a front: relayed whole to a worker that has the model's template and
tokenizer (a Tributary worker on the real model, or a fake OpenAI server that answers as a
test scripts it), byte for byte, with the front's retries, deadline and disconnect
handling."""

from __future__ import annotations

import json
import logging
import math
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from hypercorn.trio import serve
from prometheus_client.parser import text_string_to_metric_families
from remotehelpers import SLOW, fake_worker_request, start_worker

from tributary import app, testing
from tributary.app.http.limits import Deadline
from tributary.app.observe.timing import RequestTiming
from tributary.app.openai.relay import _Relayed, routing_key
from tributary.app.server import hypercorn_config
from tributary.engine import EngineConfig, open_engine
from tributary.engine.remote import RemoteConfig, RemoteEngine, open_remote_engine

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "temperature": 0}
ADMIN_KEY = "boss"


@asynccontextmanager
async def open_chat_fleet(
    *, dead_first: bool = False, sim: bool = False, **remote: Any
) -> AsyncIterator[tuple[str, str, Any]]:
    """A worker (the real model, or the sim runner, which has no chat template) and a front
    over it, optionally with a dead worker tried first; yields (front URL, worker URL,
    worker)."""
    config = (
        EngineConfig(runner="sim", sim_latency=SLOW)
        if sim
        else EngineConfig(context_length=4096, max_running_requests=2)
    )
    async with trio.open_nursery() as nursery, open_engine(config) as engine:
        worker = await start_worker(nursery, engine)
        urls = [worker.url]
        if dead_first:
            with socket.socket() as sock:  # a port nobody listens on
                sock.bind(("127.0.0.1", 0))
                urls.insert(0, f"http://127.0.0.1:{sock.getsockname()[1]}")
        options = {"policy": "round_robin", "health_check_interval": 0, **remote}
        rconfig = RemoteConfig(workers=tuple((u, "sglang") for u in urls), **options)
        async with open_remote_engine(rconfig) as front:
            settings = testing.server_settings(admin_api_key=ADMIN_KEY)  # for /list_workers
            async with app.open_http_server(front, settings) as front_urls:
                yield front_urls[0], worker.url, worker
        nursery.cancel_scope.cancel()


def contents(events: list[Any]) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in events
        if isinstance(c, dict) and c.get("choices")
    )


async def test_chat_at_the_front_is_the_workers_answer() -> None:
    async with (
        open_chat_fleet() as (front, worker, _),
        httpx.AsyncClient(timeout=60) as client,
    ):
        body = {**CHAT, "model": MODEL, "max_tokens": 24}
        direct = (await client.post(f"{worker}/v1/chat/completions", json=body)).json()
        relayed = await client.post(f"{front}/v1/chat/completions", json=body)
        assert relayed.status_code == 200
        answer = relayed.json()
        assert answer["object"] == "chat.completion" and answer["model"] == MODEL
        assert answer["choices"][0]["message"] == direct["choices"][0]["message"]
        assert answer["choices"][0]["message"]["content"]
        # The front's ask is the worker's second: the prompt is restored whole from its
        # prefix cache, and the usage says so.
        cached = {**direct["usage"], "prompt_tokens_details": {"cached_tokens": 0}}
        cached["prompt_tokens_details"]["cached_tokens"] = direct["usage"]["prompt_tokens"]
        assert direct["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert answer["usage"] == cached
        # Streamed, with usage: the same text, chunk by chunk, then the usage and [DONE].
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        streamed = await client.post(f"{front}/v1/chat/completions", json=stream_body)
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = testing.parse_sse(streamed.text)
        assert events[-1] == "[DONE]" and events[-2]["usage"] == cached
        assert contents(events) == direct["choices"][0]["message"]["content"]
        # A model the front does not serve is refused at the front.
        wrong = await client.post(f"{front}/v1/chat/completions", json={**CHAT, "model": "other"})
        assert wrong.status_code == 404 and "other" in wrong.json()["error"]["message"]


async def test_a_worker_that_cannot_answer_is_retried_and_a_workers_4xx_is_relayed() -> None:
    async with (
        open_chat_fleet(dead_first=True, retry_backoff=0.01) as (front, live, _),
        httpx.AsyncClient(timeout=60) as client,
    ):
        # Round robin starts at the dead worker: the refused connection is retried on the
        # live one, before any answer.
        for _ in range(2):
            answered = await client.post(
                f"{front}/v1/chat/completions", json={**CHAT, "max_tokens": 4}
            )
            assert answered.status_code == 200, answered.text
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        workers = (await client.get(f"{front}/list_workers", headers=admin)).json()["workers"]
        errors = {w["url"] == live for w in workers if w["errors_total"] == 2}
        assert errors == {False}  # the dead one failed both times; the live one never
        assert [w["errors_total"] for w in workers if w["url"] == live] == [0]
        # The worker's own 400 (a bad field) comes back as it is, not retried.
        bad = await client.post(f"{front}/v1/chat/completions", json={**CHAT, "temperature": -1})
        assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]


async def test_a_worker_without_a_template_says_so_through_the_front() -> None:
    async with (
        open_chat_fleet(sim=True) as (front, _, _),
        httpx.AsyncClient(timeout=30) as client,
    ):
        answer = await client.post(f"{front}/v1/chat/completions", json=CHAT)
        assert answer.status_code == 400 and "chat template" in answer.json()["error"]["message"]


async def test_a_worker_that_breaks_a_relayed_stream_ends_it_with_a_502_event() -> None:
    async with (
        open_chat_fleet() as (front, _, worker),
        httpx.AsyncClient(timeout=60) as client,
    ):
        body = {**CHAT, "max_tokens": 900, "ignore_eos": True, "stream": True}
        received = []
        async with client.stream("POST", f"{front}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                received.append(line)
                if len(received) == 6:
                    worker.kill()  # mid-stream: the connection to the front is cut
        events = testing.parse_sse("\n".join(received) + "\n")
        error = events[-2]["error"]
        assert events[-1] == "[DONE]" and error["type"] == "server_error"
        assert "failed mid-answer" in error["message"]
        assert contents(events)  # what had come through, once


async def test_a_relayed_stream_ends_when_its_client_leaves_or_its_deadline_passes() -> None:
    async with (
        open_chat_fleet() as (front, _, worker),
        httpx.AsyncClient(timeout=60) as client,
    ):
        body = {**CHAT, "max_tokens": 900, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{front}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            while not (await lines.__anext__()).startswith("data: {"):
                pass
            assert worker.engine.stats().running == 1
        # Leaving the relayed stream closed the worker's: its sequence is freed.
        with trio.fail_after(5):
            while worker.engine.stats().running:
                await trio.sleep(0.02)
        # A deadline shorter than the generation: output so far, a 408 event, [DONE].
        timed = await client.post(
            f"{front}/v1/chat/completions",
            json={**body, "max_tokens": 3000},  # 20 s or more: the deadline comes first
            headers={"X-Request-Timeout": "6"},  # (a first token within 6 s even when busy)
        )
        events = testing.parse_sse(timed.text)
        assert timed.status_code == 200 and events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["type"] == "timeout_error" and "timed out after 6 s" in error["message"]
        assert contents(events)
        with trio.fail_after(5):
            while worker.engine.stats().running:
                await trio.sleep(0.02)


@pytest.mark.parametrize("body", [[1, 2], "text"])
async def test_a_chat_body_that_is_not_an_object_is_a_400_at_the_front(body: Any) -> None:
    async with (
        open_chat_fleet(sim=True) as (front, _, _),
        httpx.AsyncClient(timeout=30) as client,
    ):
        answer = await client.post(
            f"{front}/v1/chat/completions",
            content=json.dumps(body),
            headers={"content-type": "application/json"},
        )
        assert answer.status_code == 400 and answer.json()["error"]["message"]


# -- a fake OpenAI worker ---------------------------------------------------------------


def fake_chat(scenario: str, **extra: Any) -> dict[str, Any]:
    """A chat body whose one message names what `FakeChatWorker` answers."""
    return {"messages": [{"role": "user", "content": scenario}], **extra}


def chunk_event(text: str) -> bytes:
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}}],
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


class FakeChatWorker:
    """An OpenAI server (ASGI) serving model "fake", whose chat answer the first message
    names: "break" (one event, then the connection cut), "gated" (one event, then the rest
    once `release` is set), "hold" (one event, then nothing until its client leaves, counted
    in `left`), "json then hold" (a JSON answer's first half, then the same), "json" (a
    whole JSON answer), "error event" (one event, then an error event and `[DONE]`)."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.left = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raw = await fake_worker_request(scope, receive, send)
        if raw is None:
            return
        if scope["path"] == "/v1/models":
            models = json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]})
            json_type = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": json_type})
            await send({"type": "http.response.body", "body": models.encode()})
            return
        scenario = json.loads(raw)["messages"][0]["content"]
        if scenario == "json":
            json_type = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": json_type})
            await send({"type": "http.response.body", "body": b'{"object": "chat.completion"}'})
            return
        if scenario == "json then hold":
            json_type = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": json_type})
            first = b'{"object": "chat.completion", '
            await send({"type": "http.response.body", "body": first, "more_body": True})
            await self._hold(receive)
            return
        sse_type = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": sse_type})
        await send({"type": "http.response.body", "body": chunk_event("Hello"), "more_body": True})
        if scenario == "break":
            raise RuntimeError("the worker fails mid-answer")  # Hypercorn cuts the connection
        if scenario == "error event":
            error = b'data: {"error": {"message": "failed", "code": 500}}\n\ndata: [DONE]\n\n'
            await send({"type": "http.response.body", "body": error})
            return
        if scenario == "hold":
            await self._hold(receive)
            return
        await self.release.wait()
        await send(
            {"type": "http.response.body", "body": chunk_event(" world") + b"data: [DONE]\n\n"}
        )

    async def _hold(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.left += 1


@asynccontextmanager
async def open_fake_fleet(**remote: Any) -> AsyncIterator[tuple[FakeChatWorker, RemoteEngine, str]]:
    """A `FakeChatWorker` on loopback and a front over it; yields (worker, front, front URL)."""
    fake = FakeChatWorker()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve, fake, hypercorn_config(testing.server_settings()))
        )
        config = RemoteConfig(workers=((binds[0], "openai"),), health_check_interval=0, **remote)
        async with (
            open_remote_engine(config) as front,
            app.open_http_server(front, testing.server_settings()) as urls,
        ):
            yield fake, front, urls[0]
        nursery.cancel_scope.cancel()


async def test_a_worker_that_keeps_breaking_relayed_streams_opens_its_breaker() -> None:
    async with (
        open_fake_fleet(breaker_failure_threshold=2) as (_, front, url),
        httpx.AsyncClient(timeout=30) as client,
    ):
        for _ in range(2):
            answer = await client.post(
                f"{url}/v1/chat/completions", json=fake_chat("break", stream=True)
            )
            events = testing.parse_sse(answer.text)
            assert events[-1] == "[DONE]" and "failed mid-answer" in events[-2]["error"]["message"]
        # Two breaks in a row: the worker is taken out of service, as for /generate.
        worker = front.fleet.workers[0]
        assert worker.errors_total == 2 and worker.breaker.state == "open"


async def test_the_workers_answer_decides_whether_the_relay_streams() -> None:
    async with open_fake_fleet() as (fake, _, url), httpx.AsyncClient(timeout=30) as client:
        # `"stream": 1` is a stream to SGLang and vLLM (pydantic reads it as true): the
        # worker's events reach the client as they come, not once the worker has finished.
        body = fake_chat("gated", stream=1)
        with trio.fail_after(10):  # (buffered, it would wait for the release below)
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                assert r.headers["x-accel-buffering"] == "no"  # as the front's own streams
                lines = r.aiter_lines()
                assert (await lines.__anext__()).startswith("data: {")
                fake.release.set()
                assert "data: [DONE]" in [line async for line in lines]
        # A JSON answer to a stream request is relayed as JSON: a deadline inside it is the
        # 408 status, not an SSE event appended to half a JSON object.
        held = await client.post(
            f"{url}/v1/chat/completions",
            json=fake_chat("json then hold", stream=True),
            headers={"X-Request-Timeout": "2"},
        )
        assert held.status_code == 408 and held.json()["error"]["type"] == "timeout_error"


async def test_a_relayed_chat_is_timed_counted_and_logged_like_a_local_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """/metrics at the front counts a relayed chat that answered (its end-to-end latency, and
    a stream's first token as the first chunk that reached the front), not one that failed;
    the access log has a line for each, with its latency."""
    caplog.set_level(logging.INFO, logger="tributary.access")

    def samples(text: str) -> dict[str, float]:
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if not sample.labels.keys() - {"model_name"}
        }

    async with open_fake_fleet() as (fake, _, url), httpx.AsyncClient(timeout=30) as client:
        scrape = partial(client.get, f"{url}/metrics")
        before = samples((await scrape()).text)
        fake.release.set()
        chat = f"{url}/v1/chat/completions"
        for failing in ("break", "error event"):
            events = testing.parse_sse(
                (await client.post(chat, json=fake_chat(failing, stream=True))).text
            )
            assert events[-1] == "[DONE]" and "error" in events[-2]
        unary = await client.post(chat, json=fake_chat("json"))
        assert unary.json() == {"object": "chat.completion"}
        streamed = await client.post(chat, json=fake_chat("gated", stream=True))
        assert testing.parse_sse(streamed.text)[-1] == "[DONE]"
        with trio.fail_after(5):  # an exchange is counted as it ends, just after its last byte
            while (after := samples((await scrape()).text))["sglang:num_requests_total"] < (
                before["sglang:num_requests_total"] + 2
            ):
                await trio.sleep(0.01)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("sglang:num_requests_total") == 2  # the failures are not answers
    assert delta("sglang:e2e_request_latency_seconds_count") == 2
    assert delta("sglang:e2e_request_latency_seconds_sum") > 0
    assert delta("sglang:time_to_first_token_seconds_count") == 1  # the stream's
    assert delta("sglang:generation_tokens_total") == 0  # the front sees no tokens
    lines = [r.__dict__["access"] for r in caplog.records if r.name == "tributary.access"]
    chats = [line for line in lines if line["route"] == "/v1/chat/completions"]
    assert [(line["status"], line["finish"]) for line in chats] == [
        (200, "error"),
        (200, "error"),
        (200, None),
        (200, None),
    ]
    assert all(line["e2e_latency"] > 0 and not line["disconnected"] for line in chats)


async def test_a_client_gone_before_the_relayed_body_starts_closes_the_workers_answer() -> None:
    async with open_fake_fleet() as (fake, front, _):
        asgi = app.create_app(front, testing.server_settings())
        request = json.dumps(fake_chat("hold", stream=True)).encode()
        messages = [{"type": "http.request", "body": request, "more_body": False}]
        headers_sent = trio.Event()

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await headers_sent.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers_sent.set()
                await trio.sleep_forever()  # the client leaves before Quart enters the body

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
            "extensions": {},
        }
        with trio.fail_after(10):
            await asgi(scope, receive, send)
        # As the exchange ends, not whenever the garbage collector gets to it.
        assert front.fleet.workers[0].in_flight == 0
        with trio.fail_after(5):
            while not fake.left:
                await trio.sleep(0.01)


def test_content_given_as_parts_routes_by_its_text() -> None:
    """The OpenAI SDKs' content parts are the same prompt as a string: one routing key.
    (Keyed by the role alone, every conversation sent as parts shared one prefix, and
    `cache_aware` sent them all to one worker.)"""

    def key(content: Any) -> str | None:
        return routing_key({"messages": [{"role": "user", "content": content}]})

    def parts(text: str) -> list[dict[str, Any]]:
        return [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": "x"}}]

    assert key(parts("Name three colours.")) == key("Name three colours.")
    assert key(parts("Name three colours.")) != key(parts("Write a haiku."))


#: A relayed stream whose content holds the error event's bytes (escaped, so no event), then
#: an error event.
ESCAPED = b'data: {"id":1,"choices":[{"delta":{"content":"data: {\\"error\\""}}]}\n\n'
FAILED = ESCAPED + b'data: {"error":{"message":"x","code":500}}\n\ndata: [DONE]\n\n'
CLEAN = ESCAPED + b"data: [DONE]\n\n"


async def relayed_answered(chunks: list[bytes]) -> bool:
    """Whether a relayed stream arriving as `chunks` counts as an answer."""

    async def arriving() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    timing = RequestTiming.start().for_item()
    body = _Relayed(arriving(), AsyncExitStack(), Deadline(None, math.inf), timing)
    async with body:
        relayed = [chunk async for chunk in body]
    assert b"".join(relayed) == b"".join(chunks)  # relayed byte for byte
    return timing.record().answered


async def test_an_error_event_split_across_chunks_fails_the_relayed_answer() -> None:
    """However the network splits a relayed stream, its error event fails it (split across
    two chunks, it went unseen and the failure counted as an answer), and escaped bytes in
    a chunk's content do not."""
    for at in range(len(FAILED) + 1):
        assert not await relayed_answered([FAILED[:at], FAILED[at:]]), at
    assert not await relayed_answered([FAILED[i : i + 1] for i in range(len(FAILED))])
    assert not await relayed_answered([FAILED[i : i + 5] for i in range(0, len(FAILED), 5)])
    for at in range(len(CLEAN) + 1):
        assert await relayed_answered([CLEAN[:at], CLEAN[at:]]), at
    assert await relayed_answered([CLEAN[i : i + 1] for i in range(len(CLEAN))])
