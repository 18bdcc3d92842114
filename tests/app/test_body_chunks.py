"""A streamed body writes each frame the moment the engine delivers it (`BodyChunks`, through
h11's own body writer), without waking the body's task, and the client still gets exactly
the stream the usual path writes: every response here is parsed by h11 from a real
Hypercorn, on every streaming endpoint, for a reader that keeps up and one that does not.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from apphelpers import (
    Server,
    chat_sim_runner,
    greedy,
    parse_sse,
    post_until_closed,
    raw_socket,
)
from test_direct_send import RawClient, check_stream, stream_body

from tributary import app, testing
from tributary.app.http import direct_send, multiplex
from tributary.engine import EngineConfig
from tributary.engine.runners.sim import SimRunner

TOKENS = 64


@pytest.fixture
def tributary_runner(tributary_engine_config: EngineConfig) -> SimRunner:
    """The sim model with a chat template, for /v1/chat/completions."""
    return chat_sim_runner(tributary_engine_config)


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How the chunks went: written at delivery (`direct`, and `rest` when the socket took
    only part), or handed to Quart by the body's task (`usual`)."""
    seen: Counter[str] = Counter()
    write, send_rest = direct_send.BodyChunks.write, direct_send.BodyChunks.send_rest
    next_chunk = {}

    def counted_write(self: direct_send.BodyChunks, data: bytes) -> bytes:
        seen["direct"] += 1
        rest = write(self, data)
        seen["rest"] += bool(rest)
        return rest

    async def counted_rest(self: direct_send.BodyChunks, rest: bytes) -> None:
        seen["sent rest"] += 1
        await send_rest(self, rest)

    monkeypatch.setattr(direct_send.BodyChunks, "write", counted_write)
    monkeypatch.setattr(direct_send.BodyChunks, "send_rest", counted_rest)
    for cls in multiplex.MultiplexedBody.__subclasses__():
        next_chunk[cls] = cls.next_chunk

        async def counted_chunk(self: Any, _original: Any = next_chunk[cls]) -> bytes:
            chunk: bytes = await _original(self)
            seen["usual"] += 1
            return chunk

        monkeypatch.setattr(cls, "next_chunk", counted_chunk)
    return seen


async def stream_once(url: str, text: str) -> bytes:
    """A cumulative /generate stream of TOKENS tokens on a connection of its own: its body."""
    client = await RawClient.connect(url)
    try:
        _, body = await client.post("/generate", stream_body(text=text))
    finally:
        client.close()
    return body


def events(body: bytes) -> list[Any]:
    parsed = parse_sse(body.decode())
    assert parsed[-1] == "[DONE]"
    return parsed[:-1]


async def unary_text(client: RawClient, text: str, tokens: int = TOKENS) -> str:
    _, body = await client.post(
        "/generate", json.dumps({"text": text, "sampling_params": greedy(tokens)}).encode()
    )
    answer: str = json.loads(body)["text"]
    return answer


async def test_a_generate_stream_is_written_at_delivery(
    sim_server: Server, paths: Counter[str]
) -> None:
    client = await RawClient.connect(sim_server.url)
    try:
        response, body = await client.post("/generate", stream_body(text="at delivery"))
        assert response.status_code == 200
        check_stream(body)
        # The same text as a unary answer; and keep-alive held through both.
        assert events(body)[-1]["text"] == await unary_text(client, "at delivery")
    finally:
        client.close()
    # The head and the first frame take the usual path, the end too; frames in between
    # are written as they come.
    assert paths["direct"] >= TOKENS - 4
    assert paths["usual"] <= 3


def chunks_text(body: bytes, key: str) -> Iterator[str]:
    for chunk in events(body):
        for choice in chunk["choices"]:
            yield choice[key].get("content") if key == "delta" else choice[key]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_an_openai_stream_is_written_at_delivery(
    sim_server: Server, paths: Counter[str], path: str
) -> None:
    if path == "/v1/completions":
        body: dict[str, Any] = {"prompt": "openai stream"}
        key = "text"
    else:
        body = {"messages": [{"role": "user", "content": "openai stream"}]}
        key = "delta"
    request = {
        **body,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    client = await RawClient.connect(sim_server.url)
    try:
        response, streamed = await client.post(path, json.dumps(request).encode())
        assert response.status_code == 200
        del request["stream_options"]
        _, unary = await client.post(path, json.dumps({**request, "stream": False}).encode())
    finally:
        client.close()
    answer = json.loads(unary)["choices"][0]
    expected = answer["text"] if key == "text" else answer["message"]["content"]
    assert "".join(t for t in chunks_text(streamed, key) if t) == expected
    assert events(streamed)[-1]["usage"]["completion_tokens"] == TOKENS
    assert paths["direct"] >= TOKENS - 4


async def test_a_streamed_batch_interleaves_its_items_at_delivery(
    sim_server: Server, paths: Counter[str]
) -> None:
    request = {
        "text": ["first item", "second item"],
        "stream": True,
        "sampling_params": greedy(TOKENS),
    }
    client = await RawClient.connect(sim_server.url)
    try:
        _, body = await client.post("/generate", json.dumps(request).encode())
        expected = [await unary_text(client, t) for t in request["text"]]
    finally:
        client.close()
    frames = events(body)
    for index in (0, 1):
        texts = [f["text"] for f in frames if f["index"] == index]
        assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
        assert texts[-1] == expected[index]
    assert paths["direct"] >= TOKENS


async def test_a_reader_that_stops_reading_gets_every_chunk_whole(
    sim_server: Server, paths: Counter[str]
) -> None:
    """The client reads nothing until the kernel's buffers are full: frames written at
    delivery went out in part, the rest followed through Hypercorn's send before anything
    else, and later frames queued for the body's task; nothing was lost or torn."""
    tokens = 1500  # cumulative frames: far more than a 4 KiB receive buffer holds
    client = RawClient(await raw_socket(sim_server.url, receive_buffer=4096))
    try:
        response, body = await client.post(
            "/generate", stream_body(tokens, text="x" * 50), pause=0.5
        )
        assert response.status_code == 200
        check_stream(body, tokens)
        # Then the connection serves on, written at delivery again.
        direct = paths["direct"]
        _, body = await client.post("/generate", stream_body(text="after"))
        check_stream(body)
    finally:
        client.close()
    assert paths["rest"] >= 1 and paths["sent rest"] == paths["rest"]
    assert paths["usual"] >= 3  # the frames that waited while the body wrote
    assert paths["direct"] - direct >= TOKENS - 4


async def test_a_client_gone_mid_stream_aborts_it_and_others_are_served(
    sim_server: Server, paths: Counter[str]
) -> None:
    got = await testing.disconnect_after(
        sim_server.url + "/generate",
        {"text": "leaving", "stream": True, "sampling_params": greedy(3000)},
        frames=20,
    )
    assert len(got) >= 20
    await testing.wait_engine_idle(sim_server.eng)
    assert paths["direct"] >= 15
    check_stream(await stream_once(sim_server.url, "next"))


async def test_no_frame_is_written_at_delivery_outside_hypercorn(
    tributary_engine: Any, paths: Counter[str]
) -> None:
    """Quart's in-memory test client has no socket: every chunk takes the usual path."""
    client = testing.AppClient(app.create_app(tributary_engine))
    response = await client.post(
        "/generate", json={"text": "in memory", "stream": True, "sampling_params": greedy(16)}
    )
    frames = parse_sse(response.text)
    assert frames[-2]["meta_info"]["completion_tokens"] == 16
    assert paths["direct"] == 0
    assert paths["usual"] >= 2


def num_requests(metrics: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith("sglang:num_requests_total"))
    return float(line.split()[-1])


async def test_a_v1_frame_that_fails_to_render_cuts_the_stream_uncounted(
    sim_server: Server, tributary_http_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on /v1: the stream is cut (no usage chunk, no [DONE]) and /metrics does not
    count it as a request answered."""
    from tributary.app.openai.streaming import ChunkStreamBody

    calls = Counter[str]()
    render = ChunkStreamBody.render_frame

    def failing(self: ChunkStreamBody, index: int, item: Any) -> bytes:
        calls["render"] += 1
        if calls["render"] == 5:
            raise RuntimeError("rendering bug")
        return render(self, index, item)

    before = num_requests((await tributary_http_client.get("/metrics")).text)
    monkeypatch.setattr(ChunkStreamBody, "render_frame", failing)
    request = {
        "prompt": "doomed",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},  # a usage chunk would end a whole stream
    }
    received = await post_until_closed(
        sim_server.url, json.dumps(request).encode(), path=b"/v1/completions"
    )
    # Each chunk carries "usage": null; the usage chunk would carry the counts.
    assert b'"usage":null' in received
    assert b"[DONE]" not in received and b'"usage":{' not in received
    await testing.wait_engine_idle(sim_server.eng)
    assert num_requests((await tributary_http_client.get("/metrics")).text) == before


async def test_a_stream_written_at_delivery_ends_at_its_deadline(
    tributary_engine: Any, paths: Counter[str]
) -> None:
    """--request-timeout on a stream whose frames went out at delivery: the 408 ends it at
    the deadline, after the frames that came before, and the request is aborted."""
    settings = testing.server_settings(request_timeout=0.3)
    async with testing.open_server(settings=settings, engine=tributary_engine) as server:
        client = await RawClient.connect(server.url)
        try:
            response, body = await client.post("/generate", stream_body(3000, text="timed"))
        finally:
            client.close()
    assert response.status_code == 200
    frames = events(body)
    assert frames[-1]["error"]["code"] == 408, frames[-1]
    texts = [f["text"] for f in frames[:-1]]
    assert len(texts) > 20 and all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert paths["direct"] > 20
    await testing.wait_engine_idle(tributary_engine)


async def test_a_frame_that_fails_to_render_ends_the_body(
    sim_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug while rendering a frame at delivery never reaches the engine's scheduler: the
    response ends (its request is aborted) and the server serves on."""
    from tributary.app.sglang.stream import EventStreamBody

    calls = Counter[str]()
    render = EventStreamBody.render_frame

    def failing(self: EventStreamBody, index: int, item: Any) -> bytes:
        calls["render"] += 1
        if calls["render"] == 5:
            raise RuntimeError("rendering bug")
        return render(self, index, item)

    monkeypatch.setattr(EventStreamBody, "render_frame", failing)
    received = await post_until_closed(sim_server.url, stream_body(3000, text="doomed"))
    assert b"[DONE]" not in received  # cut short, never completed as if whole
    await testing.wait_engine_idle(sim_server.eng)
    monkeypatch.setattr(EventStreamBody, "render_frame", render)
    check_stream(await stream_once(sim_server.url, "after the bug"))


async def test_internals_not_as_expected_turn_it_off_and_the_stream_goes_on(
    sim_server: Server, paths: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should h11 or Hypercorn change under it (`ready` raises), writing at delivery stops
    for that response and the rest of the stream takes the usual path, whole."""
    calls = Counter[str]()
    ready = direct_send.BodyChunks.ready

    def changed(self: direct_send.BodyChunks) -> bool:
        calls["ready"] += 1
        if calls["ready"] > 10:
            raise AttributeError("'Connection' object has no attribute '_writer'")
        return ready(self)

    monkeypatch.setattr(direct_send.BodyChunks, "ready", changed)
    body = await stream_once(sim_server.url, "internals changed")
    check_stream(body)
    assert calls["ready"] == 11  # off for the rest of the response once it raised
    assert (
        events(body)[-1]["text"]
        == events(await stream_once(sim_server.url, "internals changed"))[-1]["text"]
    )
    assert 5 <= paths["direct"] <= 10  # until it raised
    assert paths["usual"] >= TOKENS - 12  # then the usual path, from that response on
