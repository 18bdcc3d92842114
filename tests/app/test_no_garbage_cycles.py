"""A finished request is freed by reference counting, not left to the garbage collector.

Every object a request leaves in a reference cycle waits for a young collection, and each
collection walks them all with the event loop stopped; on the zero-cost server, the cycles of
about 60 objects a request used to cost 25-50 µs of a 4-token stream's 700 µs of CPU
(docs/benchmarks/overhead.md). These tests run requests of every shape through a real
server and look for Tributary's objects among what the collector finds
(`testing.garbage_cycles`). The remote engine's case is in tests/remote/test_front.py.
"""

from __future__ import annotations

from collections import Counter

import httpx
import trio
from apphelpers import greedy

from tributary import testing
from tributary.testing import RunningServer


async def test_finished_requests_leave_no_cycles(
    tributary_server: RunningServer, tributary_http_client: httpx.AsyncClient
) -> None:
    client = tributary_http_client
    single = {"text": "hello there", "sampling_params": greedy(6)}
    batch = {"text": ["one", "two", "three"], "sampling_params": greedy(4)}
    completion = {"prompt": "hi", "max_tokens": 5, "temperature": 0, "n": 2}
    with testing.garbage_cycles() as cycles:
        for _ in range(3):
            for body in (single, batch):
                assert (await client.post("/generate", json=body)).status_code == 200
                async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    assert "[DONE]" in (await r.aread()).decode()
            for stream in (False, True):
                r = await client.post("/v1/completions", json={**completion, "stream": stream})
                assert r.status_code == 200, r.text
        assert cycles() == Counter()


async def test_requests_that_end_early_leave_no_cycles(
    tributary_server: RunningServer, tributary_http_client: httpx.AsyncClient
) -> None:
    """A client that leaves mid-stream, and a request past its deadline."""
    client = tributary_http_client
    long = {"text": "hello", "sampling_params": greedy(400, ignore_eos=True)}
    with testing.garbage_cycles() as cycles:
        for _ in range(3):
            async with client.stream("POST", "/generate", json={**long, "stream": True}) as r:
                async for _chunk in r.aiter_bytes():
                    break  # the client leaves after the first event
            timed = await client.post("/generate", json=long, headers={"X-Request-Timeout": "0.05"})
            assert timed.status_code == 408, timed.text
        with trio.fail_after(10):  # the aborted sequences leave the engine at a step boundary
            while tributary_server.engine.stats().running:
                await trio.sleep(0.01)
        assert cycles() == Counter()
