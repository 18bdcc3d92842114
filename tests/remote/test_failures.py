"""Failures behind the front: a worker killed under load, retries bounded by count and by
the request's deadline, a client that leaves, and workers added and removed at run time."""

from __future__ import annotations

import dataclasses
import itertools
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
from remotehelpers import FAST, SLOW, generate, greedy, open_fleet, restart, sse, start_worker

from tributary import app, testing
from tributary.engine import EngineConfig, open_engine
from tributary.engine.remote import RemoteConfig, RemoteEngine, open_remote_engine


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Any]:
    response = await generate(client, url, {**body, "stream": True})
    return [response.status_code, *sse(response.text)]


async def test_a_killed_worker_under_load() -> None:
    async with (
        open_fleet(3, latency=SLOW, breaker_failure_threshold=2) as fleet,
        httpx.AsyncClient(timeout=30) as client,
    ):
        victim = fleet.workers[1]
        body = {"text": "steady load", "sampling_params": greedy(50)}
        streams: list[list[Any]] = []
        async with trio.open_nursery() as nursery:

            async def one() -> None:
                streams.append(await _stream(client, fleet.url, body))

            for _ in range(6):  # two on each worker (round robin)
                nursery.start_soon(one)
            with trio.fail_after(5):
                while victim.engine.stats().running < 2:
                    await trio.sleep(0.01)
            await trio.sleep(0.1)  # each has streamed some tokens
            victim.kill()
        cut = [s for s in streams if "error" in s[-2]]
        whole = [s for s in streams if "error" not in s[-2]]
        assert len(cut) == 2 and len(whole) == 4
        for events in cut:
            # A clean end: status 200 (the stream had started), the tokens so far once each,
            # then one error item and [DONE].
            assert events[0] == 200 and events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == 502
            texts = [e["text"] for e in events[1:-2]]
            assert texts and all(b.startswith(a) for a, b in itertools.pairwise(texts))
        # New requests succeed elsewhere while it is down; its breaker opens.
        answers = [
            await generate(client, fleet.url, {**body, "sampling_params": greedy(3)})
            for _ in range(6)
        ]
        assert [a.status_code for a in answers] == [200] * 6
        state = {w.url: w for w in fleet.front.worker_stats()}[victim.url]
        assert state.breaker != "closed" and state.breaker_opened_total >= 1
        assert state.errors_total >= 2
        # Back on the same port: after the breaker's open time it is used again.
        async with trio.open_nursery() as nursery:
            await restart(nursery, victim)
            before = victim.engine.stats().generated_tokens
            with trio.fail_after(10):
                while victim.engine.stats().generated_tokens == before:
                    response = await generate(
                        client, fleet.url, {**body, "sampling_params": greedy(3)}
                    )
                    assert response.status_code == 200
                    await trio.sleep(0.05)
            assert {w.url: w for w in fleet.front.worker_stats()}[victim.url].breaker == "closed"
            victim.kill()


async def test_a_client_that_leaves_frees_the_sequence_on_the_worker() -> None:
    async with open_fleet(1, latency=SLOW) as fleet, httpx.AsyncClient(timeout=30) as client:
        worker = fleet.workers[0]
        body = {"text": "leave early", "sampling_params": greedy(500), "stream": True}
        events = await testing.disconnect_after(f"{fleet.url}/generate", body, frames=2)
        assert len(events) >= 2
        left = trio.current_time()
        with trio.fail_after(2):
            while True:
                load = (await client.get(f"{worker.url}/get_load")).json()[0]
                if load["num_reqs"] == 0:
                    break
                await trio.sleep(0.005)
        # The worker's step is ~20 ms; the abort reaches it within about one.
        assert trio.current_time() - left < 0.2
        await testing.wait_engine_idle(worker.engine, timeout=1)
        assert fleet.front.load().num_reqs == 0
        # ... and the worker was told by rid too (an SGLang worker waits 2 s before aborting
        # a stream whose client left; its /abort_request acts at once).
        with trio.fail_after(2):
            while (
                'endpoint="/abort_request"' not in (await client.get(f"{worker.url}/metrics")).text
            ):
                await trio.sleep(0.01)


def _dead_urls(count: int) -> list[str]:
    """Loopback URLs nobody listens on (bound, then closed)."""
    urls = []
    for _ in range(count):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            urls.append(f"http://127.0.0.1:{sock.getsockname()[1]}")
    return urls


@asynccontextmanager
async def dead_front(**options: Any) -> AsyncIterator[tuple[RemoteEngine, str]]:
    """A front (and its URL) over five workers that refuse every connection."""
    workers = tuple((u, "sglang") for u in _dead_urls(5))
    config = RemoteConfig(workers=workers, health_check_interval=0, **options)
    async with (
        open_remote_engine(config) as front,
        app.open_http_server(front, testing.server_settings()) as urls,
    ):
        yield front, urls[0]


async def test_retries_are_bounded_by_count() -> None:
    async with (
        dead_front(max_retries=2, retry_backoff=0.01) as (front, url),
        httpx.AsyncClient(timeout=30) as client,
    ):
        response = await generate(client, url, {"text": "hi", "sampling_params": greedy(2)})
        assert response.status_code == 503, response.text
        stats = front.worker_stats()
        assert sum(w.requests_total for w in stats) == 3  # the first try and two retries
        assert sum(w.retries_total for w in stats) == 2
        streamed = await _stream(client, url, {"text": "hi", "sampling_params": greedy(2)})
        assert streamed[0] == 200 and streamed[1]["error"]["code"] == 503
        assert streamed[-1] == "[DONE]"


async def test_retries_stop_at_the_deadline() -> None:
    async with (
        dead_front(max_retries=4, retry_backoff=0.2, breaker_failure_threshold=100) as (front, url),
        httpx.AsyncClient(timeout=30) as client,
    ):
        started = trio.current_time()
        response = await client.post(
            f"{url}/generate",
            json={"text": "hi", "sampling_params": greedy(2)},
            headers={"X-Request-Timeout": "0.5"},
        )
        assert response.status_code in (503, 408), response.text
        assert trio.current_time() - started < 0.5
        # Backoffs 0.2 then 0.4: the second retry would pass the deadline.
        assert sum(w.requests_total for w in front.worker_stats()) == 2


async def test_workers_added_and_removed_at_run_time_need_the_admin_key() -> None:
    async with (
        open_fleet(2, front_settings={"admin_api_key": "boss"}) as fleet,
        httpx.AsyncClient(timeout=30) as client,
    ):
        first, second = fleet.workers
        boss = {"Authorization": "Bearer boss"}
        refused = await client.post(f"{fleet.url}/remove_worker", params={"url": second.url})
        assert refused.status_code == 401
        removed = await client.post(
            f"{fleet.url}/remove_worker", params={"url": second.url}, headers=boss
        )
        assert removed.status_code == 200 and removed.json()["url"] == second.url
        listed = (await client.get(f"{fleet.url}/list_workers", headers=boss)).json()["workers"]
        assert [w["url"] for w in listed] == [first.url]
        before = second.engine.stats().generated_tokens
        for _ in range(4):
            ok = await generate(client, fleet.url, {"text": "x", "sampling_params": greedy(2)})
            assert ok.status_code == 200
        assert second.engine.stats().generated_tokens == before
        missing = await client.post(
            f"{fleet.url}/remove_worker", json={"url": second.url}, headers=boss
        )
        assert missing.status_code == 404
        added = await client.post(
            f"{fleet.url}/add_worker", json={"url": second.url, "kind": "sglang"}, headers=boss
        )
        assert added.status_code == 200, added.text
        again = await client.post(f"{fleet.url}/add_worker", json={"url": second.url}, headers=boss)
        assert again.status_code == 400
        for _ in range(4):
            await generate(client, fleet.url, {"text": "x", "sampling_params": greedy(2)})
        assert second.engine.stats().generated_tokens > before
        metrics = (await client.get(f"{fleet.url}/metrics")).text
        # Labelled by number (added again, the second worker is worker 3), never by URL.
        assert added.json()["id"] == 3
        assert 'tributary:worker_requests_total{worker="3"}' in metrics
        assert 'tributary:worker_breaker_state{state="closed",worker="1"} 1.0' in metrics
        assert first.url not in metrics and second.url not in metrics


@pytest.mark.parametrize("field", ["json_schema", "stop_regex"])
async def test_the_openai_kind_against_a_tributary_v1(field: str) -> None:
    async with (
        open_fleet(2, kind="openai") as fleet,
        httpx.AsyncClient(timeout=30) as client,
    ):
        body = {"text": "openai upstream", "sampling_params": greedy(10, stop=["zz"])}
        front = (await generate(client, fleet.url, body)).json()
        direct = (await generate(client, fleet.workers[0].url, body)).json()
        assert front["text"] == direct["text"]
        assert front["meta_info"]["completion_tokens"] == direct["meta_info"]["completion_tokens"]
        assert front["meta_info"]["finish_reason"]["type"] == "length"
        streamed = await _stream(client, fleet.url, {**body, "text": ["a", "b"]})
        assert streamed[0] == 200 and streamed[-1] == "[DONE]"
        value = '{"type": "object"}' if field == "json_schema" else ["x+"]
        refused = await generate(
            client, fleet.url, {"text": "x", "sampling_params": greedy(2, **{field: value})}
        )
        assert refused.status_code == 400
        assert field in refused.json()["error"]["message"]


async def test_the_openai_kind_keeps_the_stop_that_matched() -> None:
    """A Tributary or SGLang /v1 worker says what matched as `matched_stop` (vLLM as
    `stop_reason`): the front's finish_reason is the worker's own /generate one."""
    async with (
        open_fleet(1, kind="openai") as fleet,
        httpx.AsyncClient(timeout=30) as client,
    ):
        worker = fleet.workers[0].url
        body = {"text": "openai upstream", "sampling_params": greedy(10)}
        whole = (await generate(client, worker, body)).json()["text"]
        body["sampling_params"] = greedy(10, stop=[whole[4:6]])
        direct = (await generate(client, worker, body)).json()
        assert direct["meta_info"]["finish_reason"] == {"type": "stop", "matched": whole[4:6]}
        for stream in (False, True):
            answer = await generate(client, fleet.url, {**body, "stream": stream})
            last = answer.json() if not stream else sse(answer.text)[-2]
            assert last["meta_info"]["finish_reason"] == direct["meta_info"]["finish_reason"]


async def test_a_client_that_leaves_frees_the_sequence_on_an_openai_kind_worker() -> None:
    async with (
        open_fleet(1, latency=SLOW, kind="openai") as fleet,
        httpx.AsyncClient(timeout=30) as client,
    ):
        worker = fleet.workers[0]
        body = {"text": "leave early", "sampling_params": greedy(500), "stream": True}
        await testing.disconnect_after(f"{fleet.url}/generate", body, frames=2)
        # No /abort_request on an OpenAI server: closing the upstream stream is the abort.
        with trio.fail_after(2):
            while (await client.get(f"{worker.url}/get_load")).json()[0]["num_reqs"]:
                await trio.sleep(0.005)
        await testing.wait_engine_idle(worker.engine, timeout=1)


async def test_a_front_started_before_its_workers_learns_the_model_once_one_is_up() -> None:
    """Workers load their model for minutes, so a front usually starts first: the model it
    serves (the name /v1 requests must give, /v1/models) becomes the worker's once one is up,
    not the stand-in it started with."""
    (url,) = _dead_urls(1)
    config = EngineConfig(runner="sim", sim_latency=FAST)
    rconfig = RemoteConfig(
        workers=((url, "sglang"),), health_check_interval=0.05, breaker_open_seconds=0.1
    )
    async with (
        trio.open_nursery() as nursery,
        open_engine(config) as engine,
        httpx.AsyncClient(timeout=30) as client,
        open_remote_engine(rconfig) as front,
        app.open_http_server(front, testing.server_settings()) as urls,
    ):
        assert front.model_info.name == "remote"
        worker = await start_worker(nursery, engine, port=int(url.rsplit(":", 1)[1]))
        model = (await client.get(f"{worker.url}/v1/models")).json()["data"][0]["id"]
        assert model != "remote"
        with trio.fail_after(3):
            while (await client.get(f"{urls[0]}/v1/models")).json()["data"][0]["id"] != model:
                await trio.sleep(0.02)
        body = {"model": model, "prompt": "hi", "max_tokens": 2, "temperature": 0}
        completion = await client.post(f"{urls[0]}/v1/completions", json=body)
        assert completion.status_code == 200, completion.text
        assert completion.json()["model"] == model
        worker.kill()


async def test_an_openai_worker_added_again_is_asked_its_model_again() -> None:
    """A vLLM redeployed at the same URL with another model: removed, then added again, it
    gets requests naming its new model, not the one the front asked its predecessor."""
    (url,) = _dead_urls(1)
    port = int(url.rsplit(":", 1)[1])
    old_config = EngineConfig(runner="sim", sim_latency=FAST, served_model_name="old-model")
    new_config = dataclasses.replace(old_config, served_model_name="new-model")
    rconfig = RemoteConfig(workers=((url, "openai"),), health_check_interval=0)
    body = {"text": "hi", "sampling_params": greedy(2)}
    async with (
        trio.open_nursery() as nursery,
        open_engine(old_config) as old,
        open_engine(new_config) as new,
        httpx.AsyncClient(timeout=30) as client,
    ):
        worker = await start_worker(nursery, old, port=port)
        async with (
            open_remote_engine(rconfig) as front,
            app.open_http_server(front, testing.server_settings()) as urls,
        ):
            assert (await generate(client, urls[0], body)).status_code == 200
            front.remove_worker(url)
            worker.kill()
            worker = await start_worker(nursery, new, port=port)
            front.add_worker(url, "openai")
            answer = await generate(client, urls[0], body)
            assert answer.status_code == 200, answer.text
            assert new.stats().generated_tokens == 2
        worker.kill()
