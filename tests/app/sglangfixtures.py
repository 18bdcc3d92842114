"""The real model behind two Hypercorn sockets (cumulative and incremental streaming) and the
helpers that send what SGLang's clients send and read back what they read.

Test modules import the helpers and the `model` fixture (as `model_fixture`, so a test's
`model` argument does not shadow an import) with `from sglangfixtures import ...`
(tests/app/conftest.py puts this directory on sys.path)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
import pytest
import trio
from apphelpers import Server, parse_sse, running_server, server_settings

from tributary import app
from tributary.engine import EngineConfig

#: Small context so the model loads fast; one llama.cpp thread because another process may
#: hold one of the machine's two cores (threads then spin-wait on each other).
MODEL = EngineConfig(context_length=2048, max_running_requests=8, threads=1)

#: The header SGLang's `sglang.utils.http_request` (and its streaming `requests.post`) sends.
SGLANG_HEADERS = {"Content-Type": "application/json; charset=utf-8"}

#: How a test may talk to /generate: one JSON object, a JSON array, or an SSE stream from the
#: cumulative or the incremental server.
Mode = Literal["unary", "batch", "cumulative", "incremental"]
MODES: tuple[Mode, ...] = ("unary", "batch", "cumulative", "incremental")


@dataclasses.dataclass
class Model:
    """One engine; `client` talks to the default (cumulative streaming) server,
    `incremental` to a second server on the same engine with `incremental_streaming_output`."""

    server: Server
    client: httpx.AsyncClient
    incremental: httpx.AsyncClient

    def tokenize(self, text: str) -> list[int]:
        return self.server.eng.tokenize(text)


@pytest.fixture(name="model")
async def model_fixture() -> AsyncIterator[Model]:
    async with running_server(MODEL) as server:
        incremental_app = app.create_app(
            server.eng, server_settings(incremental_streaming_output=True)
        )
        async with app.open_http_server(incremental_app, server_settings()) as urls:
            async with (
                httpx.AsyncClient(base_url=server.url, timeout=120) as client,
                httpx.AsyncClient(base_url=urls[0], timeout=120) as incremental,
            ):
                yield Model(server, client, incremental)


async def sglang_post(
    client: httpx.AsyncClient, body: dict[str, Any] | None, path: str = "/generate"
) -> httpx.Response:
    """POST `body` the way SGLang's clients do: `json.dumps` with its default separators,
    UTF-8, and `Content-Type: application/json; charset=utf-8` (no body: an empty POST)."""
    content = b"" if body is None else json.dumps(body).encode()
    return await client.post(path, content=content, headers=SGLANG_HEADERS)


async def generate(client: httpx.AsyncClient, body: dict[str, Any]) -> Any:
    """A /generate that must succeed; its decoded JSON."""
    response = await sglang_post(client, body)
    assert response.status_code == 200, response.text
    return response.json()


async def stream_frames(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data frames of a streamed /generate (which must end with exactly one [DONE])."""
    response = await sglang_post(client, {**body, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    return events[:-1]


def client_stream_text(frames: list[dict[str, Any]]) -> str:
    """What SGLang's `RuntimeEndpoint.generate_stream` hands the program: it takes
    `data["text"][pos:]` of each frame, so it assumes the text only ever grows."""
    pos, pieces = 0, []
    for data in frames:
        chunk = data["text"][pos:]
        pos += len(chunk)
        pieces.append(chunk)
    return "".join(pieces)


@dataclasses.dataclass
class Result:
    """One item's outcome, however it was delivered."""

    text: str
    output_ids: list[int]
    meta: dict[str, Any]  # the terminal meta_info
    frames: list[dict[str, Any]]  # stream frames of this item ([] for unary)

    @property
    def finish_reason(self) -> Any:
        return self.meta["finish_reason"]


def _unary_result(obj: dict[str, Any]) -> Result:
    assert "error" not in obj, obj
    return Result(obj["text"], obj["output_ids"], obj["meta_info"], [])


def _stream_results(frames: list[dict[str, Any]], count: int, incremental: bool) -> list[Result]:
    by_index: dict[int, list[dict[str, Any]]] = {}
    for frame in frames:
        assert "error" not in frame, frame
        by_index.setdefault(frame.get("index", 0), []).append(frame)
    assert sorted(by_index) == list(range(count)), sorted(by_index)
    results = []
    for i in range(count):
        own = by_index[i]
        assert own[-1]["meta_info"]["finish_reason"] is not None
        assert all(f["meta_info"]["finish_reason"] is None for f in own[:-1])
        if incremental:
            text = "".join(f["text"] for f in own)
            ids = [t for f in own for t in f["output_ids"]]
        else:
            for previous, frame in itertools.pairwise(own):
                # Cumulative frames only grow: text once sent is never taken back.
                assert frame["text"].startswith(previous["text"]), (previous, frame)
                assert frame["output_ids"][: len(previous["output_ids"])] == previous["output_ids"]
            text, ids = own[-1]["text"], own[-1]["output_ids"]
        assert own[-1]["meta_info"]["completion_tokens"] == len(ids)
        results.append(Result(text, ids, own[-1]["meta_info"], own))
    return results


async def run_mode(model: Model, mode: Mode, bodies: list[dict[str, Any]]) -> list[Result]:
    """Send single-prompt `bodies` in `mode`: concurrent requests ("unary"), or merged into one
    batch request (the other modes: "batch" unary, or a batch stream). Results in order."""
    if mode == "unary":
        objs: list[Any] = [None] * len(bodies)

        async def one(i: int) -> None:
            objs[i] = await generate(model.client, bodies[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(bodies)):
                nursery.start_soon(one, i)
        return [_unary_result(obj) for obj in objs]
    batch = merge_batch(bodies)
    if mode == "batch":
        items = await generate(model.client, batch)
        assert isinstance(items, list) and len(items) == len(bodies)
        return [_unary_result(item) for item in items]
    client = model.incremental if mode == "incremental" else model.client
    frames = await stream_frames(client, batch)
    return _stream_results(frames, len(bodies), incremental=mode == "incremental")


def merge_batch(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """Single-prompt bodies as one batch body: `text` and `sampling_params` become lists;
    every other top-level key must be the same in all bodies."""
    merged: dict[str, Any] = {
        "text": [b["text"] for b in bodies],
        "sampling_params": [b.get("sampling_params", {}) for b in bodies],
    }
    for key in {k for b in bodies for k in b} - {"text", "sampling_params"}:
        values = [b.get(key) for b in bodies]
        assert all(v == values[0] for v in values), key
        merged[key] = values[0]
    return merged
