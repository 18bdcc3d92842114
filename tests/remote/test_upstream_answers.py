"""How the front treats what a worker answers (a scripted SGLang-like worker beside a real
Tributary one): 503 and a shutting-down abort before any output are retried elsewhere; a 400
is the client's and comes back as is; an error frame after the first output ends the item
with that error, never a retry."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import trio
from hypercorn.trio import serve
from remotehelpers import generate, greedy, open_fleet, sse

from tributary import app, testing
from tributary.app.server import hypercorn_config
from tributary.engine.remote import RemoteConfig, RemoteEngine, open_remote_engine

#: (status, SSE frames) a scripted worker answers every /generate with (status 0: never).
Script = tuple[int, list[Any]]


def frame(text: str, completion: int, finish: Any = None) -> dict[str, Any]:
    meta = {"id": "x", "finish_reason": finish, "prompt_tokens": 2}
    meta |= {"completion_tokens": completion, "cached_tokens": 0}
    return {"text": text, "output_ids": list(range(completion)), "meta_info": meta}


def scripted_app(script: Script, clients: list[Any] | None = None) -> Callable[..., Any]:
    """The worker; `clients` gets the (host, port) of each /generate's connection."""
    status, frames = script

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        while (await receive()).get("more_body"):
            pass
        if status == 0:
            await trio.sleep_forever()  # a worker that never answers
        if clients is not None and scope["path"] == "/generate":
            clients.append(tuple(scope["client"]))
        if scope["path"] != "/generate":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        if status != 200:
            body = json.dumps({"error": {"message": "scripted refusal", "code": status}})
            headers = [(b"content-type", b"application/json")]
        else:
            body = "".join(f"data: {json.dumps(f)}\n\n" for f in frames) + "data: [DONE]\n\n"
            headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body.encode()})

    return asgi


@asynccontextmanager
async def scripted_front(
    script: Script, *, with_real: bool, clients: list[Any] | None = None
) -> AsyncIterator[tuple[RemoteEngine, str, str]]:
    """A front over a scripted worker (and a real Tributary worker when `with_real`); yields
    the front engine, its URL and the scripted worker's URL."""
    async with trio.open_nursery() as nursery:
        config = hypercorn_config(testing.server_settings())
        binds = await nursery.start(partial(serve, scripted_app(script, clients), config))
        fake = binds[0]
        async with open_fleet(1 if with_real else 0) as fleet:
            workers = [(fake, "sglang"), *((w.url, "sglang") for w in fleet.workers)]
            rconfig = RemoteConfig(
                workers=tuple(workers),  # type: ignore[arg-type]
                policy="round_robin",
                health_check_interval=0,
                retry_backoff=0.01,
            )
            async with (
                open_remote_engine(rconfig) as front,
                app.open_http_server(front, testing.server_settings()) as urls,
            ):
                yield front, urls[0], fake
        nursery.cancel_scope.cancel()


def stats_of(front: RemoteEngine, url: str) -> Any:
    return {w.url: w for w in front.worker_stats()}[url]


async def test_a_503_or_a_leaving_worker_before_any_output_is_retried_elsewhere() -> None:
    leaving = {"type": "abort", "message": "The server is shutting down.", "status_code": 503}
    for script in [(503, []), (200, [frame("", 0, leaving)])]:
        async with (
            scripted_front(script, with_real=True) as (front, url, fake),
            httpx.AsyncClient(timeout=30) as client,
        ):
            for _ in range(4):
                ok = await generate(client, url, {"text": "hi", "sampling_params": greedy(3)})
                assert ok.status_code == 200, ok.text
                assert ok.json()["meta_info"]["finish_reason"]["type"] == "length"
            refused = stats_of(front, fake)
            assert refused.requests_total >= 1
            assert refused.retries_total == refused.requests_total


async def test_a_400_is_the_clients_and_is_not_retried() -> None:
    async with (
        scripted_front((400, []), with_real=False) as (front, url, fake),
        httpx.AsyncClient(timeout=30) as client,
    ):
        refused = await generate(client, url, {"text": "hi", "sampling_params": greedy(3)})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == "scripted refusal"
        worker = stats_of(front, fake)
        assert (worker.requests_total, worker.errors_total, worker.breaker) == (1, 0, "closed")


async def test_an_error_frame_after_output_ends_the_item_without_a_retry() -> None:
    error = {"error": {"message": "worker fell over", "code": 500}}
    async with (
        scripted_front((200, [frame(" a", 1), error]), with_real=True) as (front, url, fake),
        httpx.AsyncClient(timeout=30) as client,
    ):
        answers = []
        for _ in range(2):  # round robin: one of them on the scripted worker
            body = {"text": "hi", "stream": True, "sampling_params": greedy(3)}
            answers.append(sse((await generate(client, url, body)).text))
        broken = [a for a in answers if "error" in a[-2]]
        assert len(broken) == 1
        events = broken[0]
        assert events[0]["text"] == " a" and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == 500
        assert stats_of(front, fake).retries_total == 0


async def test_a_worker_removed_before_the_first_output_ends_the_items_it_had() -> None:
    """Removed while it holds a request it has whole, before any output: the item ends with
    a 503 rather than going to another worker (a worker that had a request is never the
    reason to hand it on: it may be what broke the worker). The other request is served."""
    async with (
        scripted_front((0, []), with_real=True) as (front, url, fake),
        httpx.AsyncClient(timeout=30) as client,
    ):
        results: list[httpx.Response] = []
        async with trio.open_nursery() as nursery:

            async def one() -> None:
                body = {"text": "hi", "sampling_params": greedy(3)}
                results.append(await generate(client, url, body))

            for _ in range(2):  # round robin: one of them hangs on the scripted worker
                nursery.start_soon(one)
            with trio.fail_after(5):  # until the scripted worker has the whole request
                while not any(
                    item.tracker is not None
                    and item.tracker.sent
                    and item.worker is not None
                    and item.worker.url == fake
                    for item in front._live.values()
                ):
                    await trio.sleep(0.01)
            front.remove_worker(fake)
        assert sorted(r.status_code for r in results) == [200, 503]
        lost = next(r for r in results if r.status_code == 503)
        assert "was removed from the fleet while it had the request" in lost.text
        assert all(w.url != fake for w in front.worker_stats())


async def test_the_connection_to_a_worker_is_kept_alive() -> None:
    """After the terminal frame the front reads the `[DONE]` that follows, so the connection
    goes back to the pool instead of being closed (one TCP connection a request)."""
    frames = [frame(" a", 1), frame(" a b", 2, {"type": "length", "length": 2})]
    clients: list[Any] = []
    async with (
        scripted_front((200, frames), with_real=False, clients=clients) as (_, url, _),
        httpx.AsyncClient(timeout=30) as client,
    ):
        for stream in (False, True, False, True):
            body = {"text": "hi", "stream": stream, "sampling_params": greedy(2)}
            answer = await generate(client, url, body)
            assert answer.status_code == 200, answer.text
    assert len(clients) == 4
    assert len(set(clients)) == 1, clients
