"""Chat completions at a front: relayed whole to a worker that has the model's template and
tokenizer (a Tributary worker on the real model), byte for byte, with the front's retries,
deadline and disconnect handling."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
from remotehelpers import SLOW, start_worker

from tributary import app, testing
from tributary.engine import EngineConfig, open_engine
from tributary.engine.remote import RemoteConfig, open_remote_engine

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "temperature": 0}


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
            async with app.open_http_server(front, testing.server_settings()) as front_urls:
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
        assert answer["usage"] == direct["usage"]
        # Streamed, with usage: the same text, chunk by chunk, then the usage and [DONE].
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        streamed = await client.post(f"{front}/v1/chat/completions", json=stream_body)
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = testing.parse_sse(streamed.text)
        assert events[-1] == "[DONE]" and events[-2]["usage"] == direct["usage"]
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
        workers = (await client.get(f"{front}/list_workers")).json()["workers"]
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
