"""Wire compatibility with SGLang: a fake upstream replays the bytes SGLang's Python server
sends on `/generate` (`data: {...}\\n\\n` events, then `data: [DONE]\\n\\n`), built from
../shared/docs/sglang-generate-contract.md (sections 3 to 6 and 9), and one Tributary
front over it must answer each client request as SGLang itself would have: same text,
output_ids, meta_info keys and values (e2e_latency is the front's own, so only its presence
and type are checked), finish_reason objects, `index` on batch stream items, statuses and
`[DONE]`.

The front always asks the worker for `"stream": true` (a unary answer is assembled at the
front), so every scenario below is a stream the fake sends in SGLang's cumulative mode (the
default: text and output_ids hold everything so far) or its incremental one
(`--incremental-streaming-output`: deltas, counters still cumulative). The client's request
text picks the scenario; the rid the fake echoes in `meta_info.id` is the one it received.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from hypercorn.trio import serve
from remotehelpers import fake_worker_request, sse

from tributary import app, testing
from tributary.app.server import hypercorn_config
from tributary.engine.remote import RemoteConfig, open_remote_engine

#: One scenario's output as SGLang's scheduler produces it: (text so far, ids so far) per
#: frame, and the terminal finish_reason.
Step = tuple[str, list[int]]

EOS = 128009
PARIS: list[Step] = [(" Paris", [12366]), (" Paris.", [12366, 13])]
#: Multi-byte UTF-8: SGLang's detokenizer only emits whole characters, so each frame's text
#: is valid; a frame may hold one token that is half of a character (no new text).
UTF8: list[Step] = [
    ("h", [71]),
    ("hé", [71, 2634]),
    ("hé", [71, 2634, 155]),  # the first byte of 日本 only: no new text yet
    ("hé 日本", [71, 2634, 155, 9012]),
    ("hé 日本 🙂", [71, 2634, 155, 9012, 77, 41]),
]
ABORT_PLAIN = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORT_400 = {"type": "abort", "message": "Bad grammar state", "status_code": 400, "err_type": "x"}
ABORT_500 = {"type": "abort", "message": "Running timeout", "status_code": 500, "err_type": None}
ERROR_NEW = {
    "error": {
        "message": "The input (9000 tokens) is longer than the model's context length (8192 "
        "tokens).",
        "type": "invalid_request_error",
        "code": 400,
        "retryable": False,
    }
}
ERROR_OLD = {"error": {"message": "Duplicate request ID found"}}

#: prompt → (steps, finish_reason) or an error frame sent before any output.
SCENARIOS: dict[str, tuple[list[Step], dict[str, Any]] | dict[str, Any]] = {
    "paris": (PARIS, {"type": "stop", "matched": EOS}),
    "length": (PARIS, {"type": "length", "length": 2}),
    "stopstr": (PARIS, {"type": "stop", "matched": "\n"}),
    "utf8": (UTF8, {"type": "length", "length": 6}),
    "abort": (PARIS, ABORT_PLAIN),
    "abort400": (PARIS, ABORT_400),
    "abort500": (PARIS, ABORT_500),
    "future": (PARIS, {"type": "wandered_off", "why": "new finish type", "at": 2}),
    "error-new": ERROR_NEW,
    "error-old": ERROR_OLD,
}
PROMPT_TOKENS, CACHED_TOKENS = 6, 4


def meta(rid: str, finish: Any, completion: int, *, first: bool) -> dict[str, Any]:
    """`meta_info` in `TokenizerManager._handle_batch_output`'s key order (contract 3.1)."""
    info: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": PROMPT_TOKENS,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": completion,
        "cached_tokens": CACHED_TOKENS,
    }
    if finish is not None:
        info["e2e_latency"] = 0.0123
    if first:
        info["response_sent_to_client_ts"] = 1767000000.125
    return info


def upstream_frames(prompt: str, rid: str, incremental: bool) -> list[dict[str, Any]]:
    """The frames SGLang streams for `prompt` (contract 5.2 and 5.4)."""
    scenario = SCENARIOS[prompt]
    if isinstance(scenario, dict):
        return [scenario]
    steps, finish = scenario
    frames = []
    prev_text, prev_ids = "", []
    for i, (text, ids) in enumerate(steps):
        last = i == len(steps) - 1
        reason = finish if last else None
        if last and finish["type"] == "abort":
            # _handle_abort_req: the whole text, only the last id, whatever the mode.
            out_text, out_ids = text, ids[-1:]
        elif incremental:
            out_text, out_ids = text[len(prev_text) :], ids[len(prev_ids) :]
        else:
            out_text, out_ids = text, list(ids)
        frames.append(
            {
                "text": out_text,
                "output_ids": out_ids,
                "meta_info": meta(rid, reason, len(ids), first=i == 0),
            }
        )
        prev_text, prev_ids = text, ids
    return frames


def sglang_unary(prompt: str, rid: str) -> tuple[int, Any]:
    """(status, body) SGLang's Python server answers a unary request with (contract 3, 6.3)."""
    scenario = SCENARIOS[prompt]
    if isinstance(scenario, dict):
        return 400, {"error": {"message": scenario["error"]["message"]}}
    steps, finish = scenario
    if finish["type"] == "abort" and finish.get("status_code") == 400:
        return 400, {"error": {"message": finish["message"]}}
    if finish["type"] == "abort" and finish.get("status_code"):
        code = finish["status_code"]
        body = {"object": "error", "message": finish["message"], "type": str(code)}
        return code, body | {"param": None, "code": code}
    text, ids = steps[-1]
    info = meta(rid, finish, len(ids), first=True)
    return 200, {"text": text, "output_ids": ids, "meta_info": info}


class FakeSGLang:
    """The ASGI app: answers `/generate` with a scenario's bytes; records each body."""

    def __init__(self, incremental: bool) -> None:
        self.incremental = incremental
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raw = await fake_worker_request(scope, receive, send)
        if raw is None:
            return
        if scope["path"] != "/generate":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"" if raw else b"{}"})
            return
        body = json.loads(raw)
        self.bodies.append(body)
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for frame in upstream_frames(body["text"], body["rid"], self.incremental):
            data = json.dumps(frame, ensure_ascii=False, separators=(",", ":"))
            chunk = f"data: {data}\n\n".encode()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await trio.sleep(0.002)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


@asynccontextmanager
async def replay_front(
    *, upstream_incremental: bool = False, front_incremental: bool = False
) -> AsyncIterator[tuple[str, FakeSGLang]]:
    """A front (RemoteEngine over the fake, one worker) on loopback; yields its URL."""
    fake = FakeSGLang(upstream_incremental)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve, fake, hypercorn_config(testing.server_settings()))
        )
        config = RemoteConfig(
            workers=((binds[0], "sglang"),), health_check_interval=0, retry_backoff=0.01
        )
        settings = testing.server_settings(incremental_streaming_output=front_incremental)
        async with open_remote_engine(config) as front, app.open_http_server(front, settings) as u:
            yield u[0], fake
        nursery.cancel_scope.cancel()


def without_latency(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` with the front's own clock readings checked and taken out of `meta_info`."""
    info = dict(obj["meta_info"])
    if info["finish_reason"] is not None:
        assert isinstance(info.pop("e2e_latency"), float)
    else:
        assert "e2e_latency" not in info
    info.pop("response_sent_to_client_ts", None)
    return {**obj, "meta_info": info}


def expected_stream(prompt: str, rid: str, incremental: bool) -> list[dict[str, Any]]:
    """What SGLang streams a client for `prompt`, clock readings taken out."""
    return [without_latency(f) for f in upstream_frames(prompt, rid, incremental)]


def body(text: Any, rid: Any, **extra: Any) -> dict[str, Any]:
    return {"text": text, "rid": rid, "sampling_params": {"max_new_tokens": 16}, **extra}


Post = Callable[[dict[str, Any]], Any]


@asynccontextmanager
async def client_of(url: str) -> AsyncIterator[Post]:
    async with httpx.AsyncClient(timeout=30) as client:

        async def post(b: dict[str, Any]) -> httpx.Response:
            return await client.post(f"{url}/generate", json=b)

        yield post


async def ask(b: dict[str, Any], **front: bool) -> httpx.Response:
    """`b` posted once to a fresh front over the fake."""
    async with replay_front(**front) as (url, _), client_of(url) as post:
        return await post(b)  # type: ignore[no-any-return]


# -- unary ------------------------------------------------------------------------------


@pytest.mark.parametrize("upstream_incremental", [False, True])
async def test_unary_answers_are_sglangs(upstream_incremental: bool) -> None:
    async with (
        replay_front(upstream_incremental=upstream_incremental) as (url, fake),
        client_of(url) as post,
    ):
        for prompt in ["paris", "length", "stopstr", "utf8", "abort", "future"]:
            answer = await post(body(prompt, f"r-{prompt}"))
            status, expected = sglang_unary(prompt, f"r-{prompt}")
            assert answer.status_code == status, (prompt, answer.text)
            assert answer.headers["content-type"].startswith("application/json")
            got = answer.json()
            assert without_latency(got) == without_latency(expected), prompt
            assert list(got["meta_info"])[:8] == list(expected["meta_info"])[:8]
        # The front always streams upstream and passes the client's rid through.
        assert all(b["stream"] is True for b in fake.bodies)
        assert [b["rid"] for b in fake.bodies][:2] == ["r-paris", "r-length"]


async def test_unary_batch_is_an_array_in_order_each_with_its_own_id() -> None:
    prompts = ["utf8", "paris", "length"]
    answer = await ask(body(prompts, ["a", "b", "c"]))
    assert answer.status_code == 200
    got = answer.json()
    assert [without_latency(g) for g in got] == [
        without_latency(sglang_unary(p, r)[1]) for p, r in zip(prompts, "abc", strict=True)
    ]


@pytest.mark.xfail(
    strict=True,
    reason="a unary batch with one failing item answers 200 with an error object in that "
    "item's place (the Rust server's shape, app/sglang/errors.py); SGLang's Python server "
    "fails the whole request: 400 {'error': {'message'}} (asyncio.gather, contract 4)",
)
async def test_a_unary_batch_with_a_failing_item_is_a_400_as_sglangs() -> None:
    answer = await ask(body(["paris", "error-old"], ["a", "b"]))
    assert answer.status_code == 400
    assert answer.json() == sglang_unary("error-old", "b")[1]


async def test_n_gives_a_list_with_fresh_rids_as_sglang_does() -> None:
    """With `n > 1` a single request becomes a list of n, each sample with a fresh uuid rid
    (`regenerate_rid`: the client's rid is not echoed, contract 1.2 and 1.3)."""
    async with replay_front() as (url, fake), client_of(url) as post:
        extra = {"sampling_params": {"max_new_tokens": 16, "n": 2}}
        answer = await post(body("paris", "q", **extra))
        assert answer.status_code == 200
        got = answer.json()
        ids = [g["meta_info"]["id"] for g in got]
        assert len(set(ids)) == 2 and all(len(i) == 32 and i != "q" for i in ids)
        assert sorted(b["rid"] for b in fake.bodies) == sorted(ids)
        for g in got:
            assert without_latency(g) == without_latency(
                sglang_unary("paris", g["meta_info"]["id"])[1]
            )


@pytest.mark.parametrize("prompt", ["abort400", "abort500"])
async def test_unary_abort_with_a_status_is_that_status(prompt: str) -> None:
    answer = await ask(body(prompt, "r"))
    status, expected = sglang_unary(prompt, "r")
    assert answer.status_code == status
    got = answer.json()
    message = got.get("message") or got["error"]["message"]
    assert message == (expected.get("message") or expected["error"]["message"])


@pytest.mark.parametrize("prompt", ["error-new", "error-old"])
async def test_unary_error_frame_is_a_400_with_its_message(prompt: str) -> None:
    answer = await ask(body(prompt, "r"))
    status, expected = sglang_unary(prompt, "r")
    assert answer.status_code == status
    assert answer.json()["error"]["message"] == expected["error"]["message"]


# -- streams ----------------------------------------------------------------------------


@pytest.mark.parametrize("upstream_incremental", [False, True])
@pytest.mark.parametrize("front_incremental", [False, True])
async def test_streams_are_sglangs_frames_in_either_mode(
    upstream_incremental: bool, front_incremental: bool
) -> None:
    """A client of the front sees what a client of SGLang in the front's mode would see,
    whichever mode the worker streams in (the last frame of an abort aside: see below)."""
    async with (
        replay_front(
            upstream_incremental=upstream_incremental, front_incremental=front_incremental
        ) as (url, _),
        client_of(url) as post,
    ):
        for prompt in ["paris", "length", "stopstr", "utf8", "future"]:
            answer = await post(body(prompt, f"s-{prompt}", stream=True))
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith("text/event-stream")
            assert answer.text.endswith("data: [DONE]\n\n")
            events = sse(answer.text)
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            got = [without_latency(e) for e in events[:-1]]
            expected = expected_stream(prompt, f"s-{prompt}", front_incremental)
            # Frames may coalesce (SGLang's own stream does so too, contract 5.2), but the
            # last one and the concatenation (incremental) or the last state (cumulative)
            # must agree; here the fake paces its frames, so they come through one for one.
            assert got == expected, prompt
            assert "index" not in events[0]


@pytest.mark.parametrize("front_incremental", [False, True])
async def test_an_abort_without_a_status_is_an_ordinary_final_frame(
    front_incremental: bool,
) -> None:
    """A client abort or abort_all (no status_code) ends a stream with an ordinary final
    frame carrying the abort finish_reason exactly, status 200, then `[DONE]` (5.4, 6.1);
    completion_tokens counts every token."""
    async with (
        replay_front(front_incremental=front_incremental) as (url, _),
        client_of(url) as post,
    ):
        answer = await post(body("abort", "r", stream=True))
        assert answer.status_code == 200
        events = sse(answer.text)
        assert events[-1] == "[DONE]"
        last = without_latency(events[-2])
        expected = expected_stream("abort", "r", incremental=False)[-1]
        assert last["meta_info"] == expected["meta_info"]
        assert last["text"] == (" Paris." if not front_incremental else ".")


@pytest.mark.xfail(
    strict=True,
    reason="a streamed abort frame whose finish_reason has a status_code (a scheduler abort: "
    "400, 500, 503 after output) reaches the front's client as a frame with finish_reason "
    "null, then an error item {'error': {'message', 'code'}}; SGLang's Python server sends "
    "it as an ordinary final frame with that finish_reason and status 200 (contract 5.4, 6.3; "
    "the error item is the Rust server's shape)",
)
@pytest.mark.parametrize("prompt", ["abort400", "abort500"])
async def test_a_streamed_abort_with_a_status_is_a_final_frame_as_sglangs(prompt: str) -> None:
    answer = await ask(body(prompt, "r", stream=True))
    assert answer.status_code == 200
    events = sse(answer.text)
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1])
    last = without_latency(events[-2])
    expected = expected_stream(prompt, "r", incremental=False)[-1]
    assert last["meta_info"] == expected["meta_info"]


@pytest.mark.xfail(
    strict=True,
    reason="a unary request whose item ends in an abort with status_code 500 or 503 answers "
    "{'error': {'message', 'code'}}; SGLang's Python server raises it as an HTTPException, "
    "whose handler answers {'object': 'error', 'message', 'type': '500', 'param': null, "
    "'code': 500} (contract 6.3; test_abort asserts object == 'error' and code == 503)",
)
async def test_a_unary_abort_with_a_5xx_has_sglangs_error_object() -> None:
    answer = await ask(body("abort500", "r"))
    status, expected = sglang_unary("abort500", "r")
    assert (answer.status_code, answer.json()) == (status, expected)


@pytest.mark.xfail(
    strict=True,
    reason="the front's unary meta_info has no response_sent_to_client_ts; SGLang's recent "
    "versions set it on every unary answer and on a stream's first frame (contract 3.1)",
)
async def test_a_unary_answer_carries_response_sent_to_client_ts() -> None:
    answer = await ask(body("paris", "r"))
    assert isinstance(answer.json()["meta_info"].get("response_sent_to_client_ts"), float)


@pytest.mark.xfail(
    strict=True,
    reason="the front's cumulative abort frame carries every output id; SGLang's carries "
    "only the last one (_handle_abort_req: output_ids[-1:], contract 5.4)",
)
async def test_a_cumulative_abort_frame_has_only_the_last_id_as_sglangs() -> None:
    answer = await ask(body("abort", "r", stream=True))
    last = sse(answer.text)[-2]
    assert last["output_ids"] == PARIS[-1][1][-1:]


@pytest.mark.parametrize("prompt", ["error-new", "error-old"])
async def test_a_stream_error_frame_is_200_then_the_error_then_done(prompt: str) -> None:
    answer = await ask(body(prompt, "r", stream=True))
    assert answer.status_code == 200
    events = sse(answer.text)
    assert events[-1] == "[DONE]" and len(events) == 2
    error = events[0]["error"]
    assert error["message"] == SCENARIOS[prompt]["error"]["message"]  # type: ignore[call-overload]
    assert error.get("code", 400) == 400


@pytest.mark.parametrize("front_incremental", [False, True])
async def test_a_batch_stream_carries_index_and_ends_with_one_done(
    front_incremental: bool,
) -> None:
    prompts = ["utf8", "paris", "length"]
    async with (
        replay_front(front_incremental=front_incremental) as (url, _),
        client_of(url) as post,
    ):
        answer = await post(body(prompts, ["a", "b", "c"], stream=True))
        assert answer.status_code == 200
        events = sse(answer.text)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        for index, (prompt, rid) in enumerate(zip(prompts, "abc", strict=True)):
            mine = [without_latency(e) for e in events[:-1] if e["index"] == index]
            expected = expected_stream(prompt, rid, front_incremental)
            assert mine == [e | {"index": index} for e in expected], prompt
