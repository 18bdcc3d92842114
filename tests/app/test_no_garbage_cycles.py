"""A finished request is freed by reference counting, not left to the garbage collector.

Every object a request leaves in a reference cycle waits for a young collection, and each
collection walks them all with the event loop stopped; on the zero-cost server, the cycles of
about 60 objects a request used to cost 25-30 µs of a 4-token stream's 700 µs of CPU
(docs/benchmarks/overhead.md). These tests run requests of every shape through a real
server with the collector saving what it finds (`gc.DEBUG_SAVEALL`) and look for
Tributary's objects among it.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import trio
from apphelpers import greedy

from tributary.testing import RunningServer


@pytest.fixture
def garbage() -> Iterator[list[object]]:
    """What the collector finds from here on (it frees nothing meanwhile)."""
    gc.collect()
    flags = gc.get_debug()
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    gc.garbage.clear()
    try:
        yield gc.garbage
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        gc.collect()


def tributary_objects(found: list[object]) -> Counter[str]:
    gc.collect()
    return Counter(
        f"{type(o).__module__}.{type(o).__qualname__}"
        for o in found
        if type(o).__module__.startswith("tributary.")
    )


async def test_finished_requests_leave_no_cycles(
    tributary_server: RunningServer,
    tributary_http_client: httpx.AsyncClient,
    garbage: list[object],
) -> None:
    client = tributary_http_client
    single = {"text": "hello there", "sampling_params": greedy(6)}
    batch = {"text": ["one", "two", "three"], "sampling_params": greedy(4)}
    completion = {"prompt": "hi", "max_tokens": 5, "temperature": 0, "n": 2}
    for _ in range(3):
        for body in (single, batch):
            assert (await client.post("/generate", json=body)).status_code == 200
            async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                assert "[DONE]" in (await r.aread()).decode()
        for stream in (False, True):
            r = await client.post("/v1/completions", json={**completion, "stream": stream})
            assert r.status_code == 200, r.text
    assert tributary_objects(garbage) == Counter()


async def test_requests_that_end_early_leave_no_cycles(
    tributary_server: RunningServer,
    tributary_http_client: httpx.AsyncClient,
    garbage: list[object],
) -> None:
    """A client that leaves mid-stream, and a request past its deadline."""
    client = tributary_http_client
    long = {"text": "hello", "sampling_params": greedy(400, ignore_eos=True), "stream": True}
    for _ in range(3):
        async with client.stream("POST", "/generate", json=long) as r:
            async for _chunk in r.aiter_bytes():
                break  # the client leaves after the first event
        timed = await client.post(
            "/generate",
            json={"text": "hello", "sampling_params": greedy(400, ignore_eos=True)},
            headers={"X-Request-Timeout": "0.05"},
        )
        assert timed.status_code == 408, timed.text
    with trio.fail_after(10):  # the aborted sequences leave the engine at a step boundary
        while tributary_server.engine.stats().running:
            await trio.sleep(0.01)
    assert tributary_objects(garbage) == Counter()
