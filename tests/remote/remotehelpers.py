"""A fleet on loopback for the remote engine's tests: Tributary workers on the sim runner,
each a real Hypercorn on its own port (killable and restartable on that port), and a front
serving from them, all in the test's Trio run (real clock)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from tributary import app, testing
from tributary.engine import Engine, EngineConfig, SimLatency, open_engine
from tributary.engine.remote import RemoteConfig, RemoteEngine, open_remote_engine

#: About 2.5 ms a decode step.
FAST = SimLatency(step_base=0.002, decode_per_seq=0.0005, prefill_per_token=0.00005)
#: About 20 ms a step: a 50-token stream lasts a second, long enough to act on mid-way.
SLOW = SimLatency(step_base=0.02, decode_per_seq=0.0005, prefill_per_token=0.00005)


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


@dataclasses.dataclass(eq=False)
class Worker:
    """A Tributary worker: one engine, served (or not) on a fixed port."""

    engine: Engine
    port: int
    url: str
    scope: trio.CancelScope

    def kill(self) -> None:
        """Stop serving at once: open connections are cut, new ones refused."""
        self.scope.cancel()


async def _serve(
    engine: Engine, settings: app.ServerSettings, *, task_status: trio.TaskStatus[Any]
) -> None:
    with trio.CancelScope() as scope:
        async with app.open_http_server(engine, settings) as urls:
            task_status.started((scope, urls[0]))
            await trio.sleep_forever()


async def start_worker(
    nursery: trio.Nursery, engine: Engine, *, port: int = 0, **settings: Any
) -> Worker:
    scope, url = await nursery.start(_serve, engine, testing.server_settings(port=port, **settings))
    return Worker(engine, int(url.rsplit(":", 1)[1]), url, scope)


async def restart(nursery: trio.Nursery, worker: Worker) -> None:
    """Serve `worker`'s engine again on its port."""
    fresh = await start_worker(nursery, worker.engine, port=worker.port)
    worker.scope = fresh.scope


@dataclasses.dataclass
class Fleet:
    workers: list[Worker]
    front: RemoteEngine
    url: str  # the front's


@asynccontextmanager
async def open_fleet(
    count: int = 3,
    *,
    latency: SimLatency = FAST,
    worker_settings: dict[str, Any] | None = None,
    front_settings: dict[str, Any] | None = None,
    kind: str = "sglang",
    **remote: Any,
) -> AsyncIterator[Fleet]:
    """`count` sim workers and a front serving from them (round robin, health checks every
    0.1 s, breakers open for 0.5 s unless `remote` says otherwise)."""
    config = EngineConfig(runner="sim", sim_latency=latency)
    async with trio.open_nursery() as nursery:
        async with _engines(config, count) as engines:
            workers = [await start_worker(nursery, e, **(worker_settings or {})) for e in engines]
            options: dict[str, Any] = {
                "policy": "round_robin",
                "health_check_interval": 0.1,
                "breaker_open_seconds": 0.5,
                "retry_backoff": 0.01,
                **remote,
            }
            rconfig = RemoteConfig(workers=tuple((w.url, kind) for w in workers), **options)
            async with open_remote_engine(rconfig) as front:  # type: ignore[arg-type]
                settings = testing.server_settings(**(front_settings or {}))
                async with app.open_http_server(front, settings) as urls:
                    yield Fleet(workers, front, urls[0])
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def _engines(config: EngineConfig, count: int) -> AsyncIterator[list[Engine]]:
    if count == 0:
        yield []
        return
    async with open_engine(config) as first, _engines(config, count - 1) as rest:
        yield [first, *rest]


def sse(body: str) -> list[Any]:
    """An SSE body's payloads (`[DONE]` stays a string)."""
    return testing.parse_sse(body)


async def generate(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post(f"{url}/generate", json=body)


def served_by(fleet: Fleet) -> list[int]:
    """Tokens each worker has generated so far."""
    return [w.engine.stats().generated_tokens for w in fleet.workers]


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)


async def fake_worker_request(scope: dict[str, Any], receive: Any, send: Any) -> bytes | None:
    """For a fake worker (an ASGI app): answers a lifespan scope's events and returns None
    once it shuts down, or returns an HTTP request's whole body."""
    if scope["type"] == "lifespan":
        while True:
            kind = (await receive())["type"].rsplit(".", 1)[-1]
            await send({"type": f"lifespan.{kind}.complete"})
            if kind == "shutdown":
                return None
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            return raw
