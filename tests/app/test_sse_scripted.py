"""Output shaping for engine outputs the sim runner cannot produce on demand (an abort carrying
a status code, a truncated channel, an exact backlog, an unknown finish_reason), using a
scripted engine behind the in-memory client."""

from __future__ import annotations

import json
from typing import Any

import trio
from apphelpers import ScriptedEngine, parse_sse

from tributary import app
from tributary.app import sglang
from tributary.app.observe.timing import RequestTiming
from tributary.app.sglang.stream import EventStreamBody
from tributary.engine import Done, Frame, Output

REJECTED = {"type": "abort", "message": "media decode failed", "status_code": 432, "err_type": "x"}


def frame(rid: str, text: str, n: int) -> Frame:
    return Frame(rid, text, [ord(c) + 3 for c in text], 3, n, 0)


def done(rid: str, text: str, n: int, reason: dict[str, Any]) -> Done:
    return Done(rid, text, [ord(c) + 3 for c in text], 3, n, 0, finish_reason=reason)


async def generate(eng: ScriptedEngine, body: dict[str, Any]) -> tuple[int, Any]:
    response = await app.create_app(eng).test_client().post("/generate", json=body)  # type: ignore[arg-type]
    text = await response.get_data(as_text=True)
    if body.get("stream") and response.status_code == 200:
        return response.status_code, parse_sse(text)
    return response.status_code, json.loads(text)


async def test_24_abort_with_status_code_unary_is_that_status() -> None:
    eng = ScriptedEngine(lambda i, rid: [frame(rid, "a", 1), done(rid, "", 1, REJECTED)])
    status, body = await generate(eng, {"text": "x"})
    assert status == 432
    assert body == {"error": {"message": "media decode failed", "code": 432}}


async def test_24_abort_with_status_code_in_stream_is_an_error_item() -> None:
    eng = ScriptedEngine(
        lambda i, rid: (
            [frame(rid, "a", 1), done(rid, "", 1, REJECTED)]
            if i == 0
            else [frame(rid, "b", 1), done(rid, "c", 2, {"type": "stop", "matched": 2})]
        )
    )
    status, events = await generate(eng, {"text": ["x", "y"], "stream": True})
    assert status == 200
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    error = {"error": {"message": "media decode failed", "code": 432}, "index": 0}
    assert error in events
    # Output produced before the rejection was sent first; the other item completed.
    item0 = [e for e in events if isinstance(e, dict) and e.get("index") == 0 and "text" in e]
    assert item0[-1]["text"] == "a" and events.index(item0[-1]) < events.index(error)
    item1 = [e for e in events if isinstance(e, dict) and e.get("index") == 1]
    assert item1[-1]["text"] == "bc" and item1[-1]["meta_info"]["finish_reason"]["type"] == "stop"


async def test_24_abort_with_status_code_in_batch_is_an_entry() -> None:
    eng = ScriptedEngine(
        lambda i, rid: (
            [done(rid, "", 0, REJECTED)]
            if i == 1
            else [done(rid, "ok", 2, {"type": "length", "length": 2})]
        )
    )
    status, body = await generate(eng, {"text": ["x", "y", "z"]})
    assert status == 200
    assert body[1] == {"error": {"message": "media decode failed", "code": 432}}
    assert body[0]["text"] == body[2]["text"] == "ok"


async def test_abort_without_status_code_is_an_ordinary_completion() -> None:
    aborted = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    eng = ScriptedEngine(lambda i, rid: [frame(rid, "ab", 2), done(rid, "", 2, aborted)])
    status, body = await generate(eng, {"text": "x"})
    assert status == 200
    assert body["text"] == "ab" and body["meta_info"]["finish_reason"] == aborted


async def test_28_truncation_after_output_in_stream() -> None:
    eng = ScriptedEngine(lambda i, rid: [frame(rid, "par", 3)])
    eng_app = app.create_app(eng)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:

        async def close_channel_later() -> None:
            await trio.testing.wait_all_tasks_blocked()
            eng.senders[0].close()  # the channel ends without Done or Error

        nursery.start_soon(close_channel_later)
        response = await eng_app.test_client().post("/generate", json={"text": "x", "stream": True})
    events = parse_sse(await response.get_data(as_text=True))
    assert events[0]["text"] == "par"
    assert events[1] == {"error": {"message": "response truncated before completion", "code": 500}}
    assert events[2:] == ["[DONE]"]


async def test_28_truncation_unary_is_500() -> None:
    eng = ScriptedEngine(lambda i, rid: [frame(rid, "par", 3)])
    eng_app = app.create_app(eng)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:

        async def close_channel_later() -> None:
            await trio.testing.wait_all_tasks_blocked()
            eng.senders[0].close()

        nursery.start_soon(close_channel_later)
        response = await eng_app.test_client().post("/generate", json={"text": "x"})
    assert response.status_code == 500
    body = json.loads(await response.get_data(as_text=True))
    assert body == {"error": {"message": "response truncated before completion", "code": 500}}


async def test_engine_shutdown_abort_is_503() -> None:
    closing = {
        "type": "abort",
        "message": "The engine is shutting down.",
        "status_code": 503,
        "err_type": "unavailable",
    }
    eng = ScriptedEngine(lambda i, rid: [done(rid, "", 0, closing)])
    status, body = await generate(eng, {"text": "x"})
    assert status == 503 and body["error"]["message"] == "The engine is shutting down."


async def test_30_unknown_finish_reason_passes_through_in_order() -> None:
    reason = {"type": "novel", "zeta": 1, "alpha": [2]}
    eng = ScriptedEngine(lambda i, rid: [done(rid, "z", 1, reason)])
    response = await app.create_app(eng).test_client().post("/generate", json={"text": "x"})  # type: ignore[arg-type]
    raw = await response.get_data(as_text=True)
    assert '"finish_reason":{"type":"novel","zeta":1,"alpha":[2]}' in raw


async def backlog_chunks(items: list[Output], *, incremental: bool) -> list[bytes]:
    """Run an EventStreamBody whose engine items are all queued before it renders anything."""
    eng = ScriptedEngine(lambda i, rid: items)
    stream = eng.submit(sglang.normalize_generate({"text": "x"}, vocab_size=259).items[0])
    body = EventStreamBody(
        [stream], RequestTiming.start(), batch=False, incremental=incremental, weight_version="w"
    )
    chunks = []
    async with body:
        await trio.testing.wait_all_tasks_blocked()  # the pump has moved every item across
        async for chunk in body:
            chunks.append(chunk)
    return chunks


BACKLOG: list[Output] = [
    frame("r", "a", 1),
    frame("r", "b", 2),
    frame("r", "c", 3),
    done("r", "d", 4, {"type": "length", "length": 4}),
]


async def test_27_cumulative_backlog_coalesces() -> None:
    eng = ScriptedEngine(lambda i, rid: BACKLOG[:3])
    stream = eng.submit(sglang.normalize_generate({"text": "x"}, vocab_size=259).items[0])
    body = EventStreamBody(
        [stream], RequestTiming.start(), batch=False, incremental=False, weight_version="w"
    )
    async with body:
        await trio.testing.wait_all_tasks_blocked()
        first = parse_sse((await body.__anext__()).decode())
        assert [e["text"] for e in first] == ["abc"]  # three queued frames, one event
        assert first[0]["meta_info"]["completion_tokens"] == 3
        eng.senders[0].send(BACKLOG[3])
        rest = b"".join([chunk async for chunk in body])
    events = parse_sse(rest.decode())
    assert events[0]["text"] == "abcd" and events[0]["meta_info"]["finish_reason"]["length"] == 4
    assert events[1:] == ["[DONE]"]


async def test_27_incremental_backlog_sends_every_delta() -> None:
    chunks = await backlog_chunks(BACKLOG, incremental=True)
    events = parse_sse(b"".join(chunks).decode())
    assert [e["text"] for e in events[:-1]] == ["a", "b", "c", "d"]
    assert [e["meta_info"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3, 4]
    assert [("e2e_latency" in e["meta_info"]) for e in events[:-1]] == [False] * 3 + [True]
    assert events[-1] == "[DONE]"
