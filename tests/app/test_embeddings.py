"""`POST /v1/embeddings` and SGLang's `/encode` on a real Hypercorn socket and the real model
(SmolLM2 declares no pooling: served with `pooling="last"`), with the official `openai`
client; bad input; /metrics and the access log; engines that compute none."""

from __future__ import annotations

import base64
import dataclasses
import logging
from collections.abc import AsyncIterator

import httpx
import llama_cpp
import msgspec
import numpy as np
import openai
import pytest
import trio
from apphelpers import (
    ScriptedEngine,
    Server,
    running_server,
    server_settings,
    sim_config,
    wait_until,
)
from openaihelpers import MODEL_CONFIG, model_name
from prometheus_client.parser import text_string_to_metric_families
from test_wire_fields import SCHEMAS, declared, differences, doc_tables

from tributary import app, engine
from tributary.app.openai.embeddings import EmbeddingBody
from tributary.app.sglang.encode import EncodeBody
from tributary.engine import Capabilities

pytestmark = pytest.mark.model

CONFIG = dataclasses.replace(MODEL_CONFIG, pooling="last")
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France."]


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with running_server(CONFIG) as server:
        yield server


@pytest.fixture
async def http(server: Server) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        yield client


async def direct(server: Server, texts: list[str]) -> list[np.ndarray]:
    """The engine's own vectors for `texts`, as a program embedding in process gets them."""
    service = Capabilities.of(server.eng).embeddings
    assert service is not None
    return await service.embed([server.eng.tokenize(t, add_special=True) for t in texts])


async def test_the_openai_client_gets_the_same_vectors_in_both_encodings(server: Server) -> None:
    client = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120
    )
    name = model_name(server)
    async with client:
        # The client asks for base64 unless told otherwise, and decodes it to floats.
        default = await client.embeddings.create(model=name, input=TEXTS)
        floats = await client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
        one = await client.embeddings.create(model=name, input=TEXTS[1])
    expected = await direct(server, TEXTS)
    assert default.object == "list" and default.model == name
    assert [d.index for d in default.data] == [0, 1]
    assert all(d.object == "embedding" for d in default.data)
    for got_b64, got_float, want in zip(default.data, floats.data, expected, strict=True):
        # base64 carries the float32 bytes: exactly the engine's vector.
        assert np.array_equal(np.array(got_b64.embedding, np.float32), want)
        # JSON numbers print each float32 as the shortest float64 that reads back as it.
        assert np.array_equal(np.array(got_float.embedding, np.float32), want)
    assert np.array_equal(np.array(one.data[0].embedding, np.float32), expected[1])
    tokens = [len(server.eng.tokenize(t, add_special=True)) for t in TEXTS]
    assert default.usage.prompt_tokens == default.usage.total_tokens == sum(tokens)


async def test_token_ids_embed_as_the_text_they_spell(
    server: Server, http: httpx.AsyncClient
) -> None:
    ids = [server.eng.tokenize(t, add_special=True) for t in TEXTS]
    by_text = (await http.post("/v1/embeddings", json={"input": TEXTS})).json()
    by_ids = (await http.post("/v1/embeddings", json={"input": ids})).json()
    one = (await http.post("/v1/embeddings", json={"input": ids[0]})).json()
    assert [d["embedding"] for d in by_ids["data"]] == [d["embedding"] for d in by_text["data"]]
    assert one["data"][0]["embedding"] == by_text["data"][0]["embedding"]
    raw = base64.b64decode(
        (
            await http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
        ).json()["data"][0]["embedding"]
    )
    assert np.frombuffer(raw, "<f4").tolist() == by_text["data"][0]["embedding"]


async def test_encode_answers_in_sglangs_shape(server: Server, http: httpx.AsyncClient) -> None:
    [want0, want1] = await direct(server, TEXTS)
    single = await http.post("/encode", json={"text": TEXTS[0], "rid": "e1"})
    assert single.status_code == 200
    body = single.json()
    assert np.array_equal(np.array(body["embedding"], np.float32), want0)
    meta = body["meta_info"]
    assert meta["id"] == "e1" and meta["prompt_tokens"] == len(server.eng.tokenize(TEXTS[0]))
    assert meta["e2e_latency"] > 0
    ids = [server.eng.tokenize(t) for t in TEXTS]
    batch = await http.put("/encode", json={"input_ids": ids, "rid": ["a", "b"]})
    assert [o["meta_info"]["id"] for o in batch.json()] == ["a", "b"]
    assert np.array_equal(np.array(batch.json()[1]["embedding"], np.float32), want1)
    bad = await http.post("/encode", json={"text": "x", "input_ids": [1]})
    assert bad.status_code == 400
    assert bad.json() == {
        "error": {"message": "Either text or input_ids should be provided.", "code": 400}
    }


#: Bodies /v1/embeddings refuses, and what its message says.
BAD = [
    ({}, "input is required"),
    ({"input": []}, "input is an empty list: there is nothing to embed."),
    ({"input": ""}, "input is an empty string: there is nothing to embed."),
    ({"input": ["a", ""]}, "input[1] is an empty string"),
    ({"input": [[1], []]}, "Input 1 is empty"),
    ({"input": 7}, "input must be a string, a list of strings, a list of token ids, or a list"),
    ({"input": ["a", 1]}, "input must be a string"),
    ({"input": [1.5]}, "input must be a string"),
    ({"input": [True]}, "input must be a string"),
    ({"input": "a", "encoding_format": "int8"}, 'encoding_format must be either "float" or'),
    ({"input": "a", "dimensions": 64}, "does not support matryoshka representation"),
    ({"input": "a", "dimensions": "64"}, "dimensions must be an integer"),
    ({"input": "a " * 2100}, "more than this model embeds in one input (2048 tokens"),
    ({"input": [[5, 10**9]]}, "Input 0 has token id 1000000000, outside the vocabulary"),
    ({"input": ["a"] * 2049}, "At most 2048 inputs"),
]


async def test_bad_input_is_a_400_that_says_what_is_wrong(http: httpx.AsyncClient) -> None:
    for body, message in BAD:
        response = await http.post("/v1/embeddings", json=body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert message in error["message"], (body, error)
        assert error["type"] == "invalid_request_error"
    other = await http.post("/v1/embeddings", json={"input": "a", "model": "nope"})
    assert other.status_code == 404


async def test_too_many_inputs_are_refused_before_any_is_tokenized(
    server: Server, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 MiB of short texts is some 400,000 inputs: tokenizing them all first took 21 s.
    tokenized: list[str] = []
    real = server.eng.tokenize

    def tokenize(text: str, **kwargs: bool) -> list[int]:
        tokenized.append(text)
        return real(text, **kwargs)

    monkeypatch.setattr(server.eng, "tokenize", tokenize)
    texts = [f"word {i}" for i in range(2049)]
    for path, body in [("/v1/embeddings", {"input": texts}), ("/encode", {"text": texts})]:
        response = await http.post(path, json=body)
        assert response.status_code == 400
        assert "At most 2048 inputs can be embedded in one request, got 2049." in response.text
    assert tokenized == []


async def test_embeddings_count_in_metrics_and_the_access_log(
    server: Server, http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tributary.access")

    def total(text: str, name: str, **labels: str) -> float:
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    route = {"endpoint": "/v1/embeddings", "method": "POST"}
    before = (await http.get("/metrics")).text
    answer = (await http.post("/v1/embeddings", json={"input": TEXTS})).json()
    await http.post("/v1/embeddings", json={"input": []})
    after = (await http.get("/metrics")).text

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("sglang:prompt_tokens_total") == answer["usage"]["prompt_tokens"]
    assert moved("sglang:num_requests_total") == len(TEXTS)  # one request per input
    assert moved("sglang:e2e_request_latency_seconds_count") == len(TEXTS)
    assert moved("sglang:http_responses_total", **route, status_code="200") == 1
    assert moved("sglang:http_responses_total", **route, status_code="400") == 1
    logged = [r.__dict__["access"] for r in caplog.records if r.name == "tributary.access"]
    embedded = [f for f in logged if f["route"] == "/v1/embeddings" and f["status"] == 200]
    assert [f["prompt_tokens"] for f in embedded] == [
        len(server.eng.tokenize(t, add_special=True)) for t in TEXTS
    ]


async def test_a_model_without_pooling_answers_400_naming_the_flag() -> None:
    async with running_server(MODEL_CONFIG) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            for path, body in [("/v1/embeddings", {"input": "hi"}), ("/encode", {"text": "hi"})]:
                response = await http.post(path, json=body)
                assert response.status_code == 400
                assert "start it with --pooling mean, last or cls" in response.text


async def test_the_sim_runner_answers_with_its_fake_vectors() -> None:
    async with running_server(sim_config()) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            openai_shape = await http.post("/v1/embeddings", json={"input": "hi"})
            sglang_shape = await http.post("/encode", json={"text": "hi"})
    vector = openai_shape.json()["data"][0]["embedding"]
    assert len(vector) == 16 and sglang_shape.json()["embedding"] == vector


async def test_an_engine_without_embeddings_answers_501_on_both_routes() -> None:
    client = app.create_app(ScriptedEngine()).test_client()  # type: ignore[arg-type]
    for path, body in [("/v1/embeddings", {"input": "hi"}), ("/encode", {"text": "hi"})]:
        response = await client.post(path, json=body)
        assert response.status_code == 501
        assert "does not compute embeddings: its runner has none." in await response.get_data(
            as_text=True
        )


@pytest.mark.parametrize(
    ("model", "component", "heading"),
    [
        (EmbeddingBody, "EmbeddingRequest", "## `POST /v1/embeddings`"),
        (EncodeBody, "EncodeRequest", "## `POST /encode`"),
    ],
)
def test_every_field_is_in_openapi_and_the_api_docs(
    model: type[msgspec.Struct], component: str, heading: str
) -> None:
    accepted = declared(model)
    assert differences(accepted, set(SCHEMAS[component]["properties"]), "openapi") == []
    rows = doc_tables(heading, "| Field |")
    assert differences(accepted, set(rows), f"docs/api.md ({heading})") == []


async def test_an_embedding_running_at_the_graceful_deadline_gets_a_readable_503(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A graceful shutdown aborts an embedding request still computing as it aborts a
    generation: after its decode in flight, with the 503 body, before the deadline (it was
    cut off at the deadline with no response)."""
    decodes: list[int] = []
    real = llama_cpp.llama_decode

    def decode(ctx: object, batch: llama_cpp.llama_batch) -> int:
        decodes.append(batch.n_tokens)
        return int(real(ctx, batch))

    monkeypatch.setattr(llama_cpp, "llama_decode", decode)
    # 300,000 tokens (the most a request may have): over a thousand decodes, far longer
    # than the graceful timeout. Aborted at the deadline less two of the slowest decodes.
    body = {"input": [[100 + (i + k) % 500 for i in range(2000)] for k in range(150)]}
    answers: list[httpx.Response] = []
    async with engine.open_engine(CONFIG) as eng:
        async with trio.open_nursery() as nursery:
            async with app.open_http_server(eng, server_settings(graceful_timeout=10.0)) as urls:
                client = httpx.AsyncClient(base_url=urls[0], timeout=60)

                async def embed() -> None:
                    answers.append(await client.post("/v1/embeddings", json=body))

                nursery.start_soon(embed)
                await wait_until(lambda: len(decodes) >= 2, timeout=30)
            shut_at = trio.current_time()
        assert trio.current_time() - shut_at < 10.0, "answered before the deadline"
        await client.aclose()
    [answer] = answers
    assert answer.status_code == 503
    assert answer.json()["error"]["message"] == "The server is shutting down."
