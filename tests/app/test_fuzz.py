"""Fuzzing `/generate`, `/v1/completions`, `/v1/chat/completions` and `/abort_request` with
Hypothesis (strategies in fuzzing.py): never a 5xx, never a crash, every 4xx body parses in
its route's error shape, a 200 is a complete answer, and after every example `/health`
answers 200 and the engine holds nothing.

Most examples go through the in-memory app (fast); a quarter as many go over a real socket
to Hypercorn. Examples are derandomized (the same every run); TRIBUTARY_FUZZ_EXAMPLES sets how
many per endpoint (150 by default; docs/reliability.md records longer runs).
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from fuzzing import EXAMPLES, VICTIM, ThreadedServer, raw_bodies, threaded_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tributary.testing import parse_sse, wait_engine_idle

PATHS = list(raw_bodies)
#: How the victims of the /abort_request examples ended (for the record: -s prints them).
VICTIM_ENDS: collections.Counter[str] = collections.Counter()
FUZZ_SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    with threaded_server() as running:
        yield running


@pytest.fixture(autouse=True)
def nothing_logged_as_an_error(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """An exception escaping the app is only logged (by Hypercorn, or our 500 handlers)."""
    yield
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


def check_answer(path: str, status: int, headers: dict[str, str], body: bytes) -> None:
    where = f"{path} -> {status}: {body[:300]!r}"
    assert status < 500, where
    if status >= 400:
        assert headers.get("content-type") == "application/json", where
        error = json.loads(body)
        if path.startswith("/v1/"):
            assert set(error["error"]) >= {"message", "type", "param", "code"}, where
        else:
            assert error["error"]["code"] == status and error["error"]["message"], where
        return
    assert status == 200, where
    if path == "/abort_request":
        assert body == b"", where
    elif headers.get("content-type", "").startswith("text/event-stream"):
        events = parse_sse(body)
        assert events and events[-1] == "[DONE]", where
        for event in events[:-1]:
            assert isinstance(event, dict), where
            failure = event.get("error")
            assert failure is None or int(failure.get("code") or 400) < 500, where
    else:
        answer = json.loads(body)
        items = answer if isinstance(answer, list) else [answer]
        for item in items:
            assert "error" not in item or item["error"]["code"] < 500, where


async def _after_example(server: ThreadedServer) -> int:
    await wait_engine_idle(server.engine, timeout=5)
    return (await server.client.get("/health")).status


def check_still_serving(server: ThreadedServer) -> None:
    assert server.run(_after_example, server) == 200


async def _post_in_memory(server: ThreadedServer, path: str, raw: bytes) -> Any:
    if path == "/abort_request":
        return await _abort_beside_a_victim(server, raw)
    return await server.client.request(
        "POST", path, body=raw, headers={"content-type": "application/json"}
    )


async def _abort_beside_a_victim(server: ThreadedServer, raw: bytes) -> Any:
    """Send the fuzzed abort while a streamed batch (rid `VICTIM`) generates, so that aborts
    by rid, by batch rid and of everything have something to abort; the victim's stream must
    end properly, each item by its length or by an abort."""
    body = {
        "text": ["a", "b"],
        "rid": VICTIM,
        "stream": True,
        "sampling_params": {"max_new_tokens": 120, "temperature": 0},
    }
    victim: list[Any] = []

    async def run_victim() -> None:
        victim.append(await server.client.post("/generate", body))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_victim)
        with trio.fail_after(5):
            while not server.engine.stats().running:
                await trio.sleep(0)
        reply = await server.client.request(
            "POST", "/abort_request", body=raw, headers={"content-type": "application/json"}
        )
    events = parse_sse(victim[0].body)
    assert victim[0].status == 200 and events[-1] == "[DONE]", victim[0].body[-300:]
    finishes = [e["meta_info"]["finish_reason"] for e in events[:-1]]
    ends = [f["type"] for f in finishes if f is not None]
    assert sorted(ends) in (["length", "length"], ["abort", "abort"], ["abort", "length"]), ends
    VICTIM_ENDS[" ".join(sorted(ends))] += 1
    return reply


@pytest.mark.parametrize("path", PATHS)
def test_fuzz_in_memory(server: ThreadedServer, path: str) -> None:
    @settings(FUZZ_SETTINGS, max_examples=EXAMPLES)
    @given(raw=raw_bodies[path])
    def example(raw: bytes) -> None:
        reply = server.run(_post_in_memory, server, path, raw)
        check_answer(path, reply.status, reply.headers, reply.body)
        check_still_serving(server)

    example()
    if VICTIM_ENDS:
        print(f"victims of the fuzzed aborts ended: {dict(VICTIM_ENDS)}")


@pytest.mark.parametrize("path", PATHS)
def test_fuzz_over_a_real_socket(server: ThreadedServer, path: str) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:

        @settings(FUZZ_SETTINGS, max_examples=max(EXAMPLES // 4, 10))
        @given(raw=raw_bodies[path], chunked=st.booleans())
        def example(raw: bytes, chunked: bool) -> None:
            # A generator body makes httpx send it chunked, without a Content-Length.
            content: Any = iter([raw]) if chunked else raw
            reply = client.post(path, content=content, headers={"content-type": "application/json"})
            headers = {k.lower(): v for k, v in reply.headers.items()}
            check_answer(path, reply.status_code, headers, reply.content)
            assert client.get("/health").status_code == 200
            check_still_serving(server)

        example()
