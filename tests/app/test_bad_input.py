"""Every malformed `/generate` body gets a 400 with SGLang's message (or a clear one where
SGLang has none) in SGLang's error shape, and the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from apphelpers import greedy, running_server, sim_config

NO_PROMPT = "Either text, input_ids or input_embeds should be provided."

# (case, body, substring of error.message)
CASES: list[tuple[str, Any, str]] = [
    ("no prompt", {"sampling_params": greedy(2)}, NO_PROMPT),
    ("null prompt", {"text": None, "input_ids": None}, NO_PROMPT),
    ("empty input_ids", {"input_ids": []}, "input_ids cannot be empty."),
    ("empty input_ids in batch", {"input_ids": [[3], []]}, "input_ids cannot be empty."),
    ("text is a number", {"text": 5}, "text must be a string or a list of strings"),
    ("text list of numbers", {"text": [1, 2]}, "text must be a string or a list of strings"),
    ("input_ids are strings", {"input_ids": "abc"}, "input_ids must be a list"),
    ("input_ids mixed", {"input_ids": [1, [2]]}, "input_ids must be a list of integers"),
    ("out-of-vocabulary id", {"input_ids": [100000]}, "out-of-vocabulary token id 100000"),
    ("stream not bool", {"text": "hi", "stream": "yes"}, "stream must be a boolean"),
    ("body is a list", ["hi"], "The request body must be a JSON object."),
    ("sampling_params a number", {"text": "hi", "sampling_params": 5}, "sampling_params must be"),
    (
        "sampling list for single",
        {"text": "hi", "sampling_params": [{}]},
        "sampling_params must be an object",
    ),
    (
        "sampling list wrong length",
        {"text": ["a", "b"], "sampling_params": [{}]},
        "The length of sampling_params should be equal to the batch size.",
    ),
    ("rid a number", {"text": "hi", "rid": 5}, "The rid should be a string or a list of strings."),
    (
        "rid list wrong length",
        {"text": ["a", "b"], "rid": ["x"]},
        "The specified rids length mismatch with the batch_size for batch processing.",
    ),
    (
        "rid list of numbers",
        {"text": ["a", "b"], "rid": [1, 2]},
        "The rid should be a string or a list of strings.",
    ),
    (
        "duplicate rids",
        {"text": ["a", "b"], "rid": ["x", "x"]},
        "Duplicate request IDs detected within the request: ['x']",
    ),
    (
        "different n per item",
        {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 1}]},
        "The parallel_sample_num should be the same for all samples in sample params.",
    ),
    ("empty batch", {"text": []}, "The batch is empty"),
    ("empty text", {"text": ""}, "texts cannot be empty"),
    (
        "hidden states not yet",
        {"text": "hi", "return_hidden_states": True},
        "return_hidden_states is not supported",
    ),
    (
        "token_ids_logprob not flat",
        {"text": "hi", "return_logprob": True, "token_ids_logprob": [[0]]},
        "token_ids_logprob must be a flat list of integers.",
    ),
    (
        "token_ids_logprob out of vocabulary",
        {"text": "hi", "return_logprob": True, "token_ids_logprob": [-1]},
        "out-of-vocabulary token id -1",
    ),
    (
        "custom logit processor not enabled",
        {"text": "hi", "custom_logit_processor": '{"callable": "00"}'},
        "--enable-custom-logit-processor",
    ),
    ("embeds not yet", {"input_embeds": [[0.1]]}, "input_embeds is not supported"),
    ("unknown sampling key", {"text": "hi", "sampling_params": {"temperatur": 0}}, "temperatur"),
    (
        "sampling wrong type",
        {"text": "hi", "sampling_params": {"max_new_tokens": "many"}},
        "max_new_tokens must be an integer",
    ),
]

SAMPLING_CASES: list[tuple[dict[str, Any], str]] = [
    ({"temperature": -1}, "temperature must be a non-negative finite number, got -1.0."),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0.0."),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
    ({"min_p": 2}, "min_p must be in [0, 1], got 2.0."),
    ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
    ({"top_k": -2}, "top_k must be -1 (disable) or at least 1, got -2."),
    ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3.0."),
    ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3.0."),
    (
        {"repetition_penalty": 0},
        "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0.0.",
    ),
    ({"repetition_penalty": 2.5}, "repetition_penalty must be in (0, 2]"),
    ({"min_new_tokens": -1}, "min_new_tokens must be in [0, max_new_tokens], got -1."),
    ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
    (
        {"max_new_tokens": 2, "min_new_tokens": 3},
        "min_new_tokens must be in [0, max_new_tokens(2)], got 3.",
    ),
    ({"logit_bias": {"999": 1.0}}, "logit_bias must has keys in [0, 258], got 999."),
    ({"stop_token_ids": [10**9], "min_new_tokens": 1}, "stop_token_ids must be in [0, 258]"),
    ({"n": 0}, "n must be at least 1, got 0."),
    ({"stream_interval": 0}, "stream_interval must be at least 1, got 0."),
    (
        {"regex": "a", "json_schema": "{}"},
        "Only one of json_schema, regex, ebnf, or structural_tag can be set.",
    ),
]


@pytest.fixture
async def small_context_client() -> Any:
    async with running_server(sim_config(context_length=256)) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            yield client


async def assert_400_then_healthy(
    client: httpx.AsyncClient, response: httpx.Response, message: str
) -> None:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == 400
    assert message in error["message"]
    assert (await client.get("/health")).status_code == 200
    ok = await client.post("/generate", json={"text": "ok", "sampling_params": greedy(2)})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize(("case", "body", "message"), CASES, ids=[c[0] for c in CASES])
async def test_bad_body(
    small_context_client: httpx.AsyncClient, case: str, body: Any, message: str
) -> None:
    response = await small_context_client.post("/generate", json=body)
    await assert_400_then_healthy(small_context_client, response, message)


@pytest.mark.parametrize(
    ("sampling", "message"), SAMPLING_CASES, ids=[str(s) for s, _ in SAMPLING_CASES]
)
async def test_invalid_sampling_value(
    small_context_client: httpx.AsyncClient, sampling: dict[str, Any], message: str
) -> None:
    for body in (
        {"text": "hi", "sampling_params": sampling},
        {"text": ["a", "b"], "sampling_params": [{}, sampling]},
    ):
        response = await small_context_client.post("/generate", json=body)
        await assert_400_then_healthy(small_context_client, response, message)


HOSTILE_JSON = {
    "syntax": b"{bad",
    "empty": b"",
    "bytes": b"\xff\xfe",
    "cut": b'{"text": "hi"',
    "5000-digit integer": b'{"text": "hi", "sampling_params": {"temperature": 1'
    + b"0" * 5000
    + b"}}",
    "nested 100000 deep": b"[" * 100_000,
    "surrogate in rid": b'{"text": "hi", "rid": "a\\ud800"}',
    "surrogate in text": b'{"text": "hi\\udfff", "stream": true}',
}


@pytest.mark.parametrize("raw", HOSTILE_JSON.values(), ids=HOSTILE_JSON.keys())
async def test_malformed_json(small_context_client: httpx.AsyncClient, raw: bytes) -> None:
    for path in ("/generate", "/v1/completions"):
        response = await small_context_client.post(
            path, content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, (path, response.text)
        assert "Invalid JSON in the request body" in response.json()["error"]["message"]
    response = await small_context_client.post(
        "/generate", content=raw, headers={"content-type": "application/json"}
    )
    await assert_400_then_healthy(
        small_context_client, response, "Invalid JSON in the request body"
    )


async def test_numbers_too_large_for_a_float_are_a_400(
    small_context_client: httpx.AsyncClient,
) -> None:
    huge = b"1" + b"0" * 400
    for sampling in (b'{"temperature": ' + huge + b"}", b'{"logit_bias": {"5": ' + huge + b"}}"):
        raw = b'{"text": "hi", "sampling_params": ' + sampling + b"}"
        response = await small_context_client.post(
            "/generate", content=raw, headers={"content-type": "application/json"}
        )
        await assert_400_then_healthy(small_context_client, response, "out of range")


async def test_prompt_longer_than_context(small_context_client: httpx.AsyncClient) -> None:
    response = await small_context_client.post("/generate", json={"text": "x" * 300})
    await assert_400_then_healthy(
        small_context_client,
        response,
        "The input (300 tokens) is longer than the model's context length (256 tokens).",
    )


async def test_prompt_plus_max_new_tokens_over_context(
    small_context_client: httpx.AsyncClient,
) -> None:
    body = {"text": "x" * 250, "sampling_params": {"max_new_tokens": 10}}
    response = await small_context_client.post("/generate", json=body)
    await assert_400_then_healthy(
        small_context_client,
        response,
        "Requested token count exceeds the model's maximum context length of 256 tokens. "
        "You requested a total of 260 tokens: 250 tokens from the input messages and 10 tokens "
        "for the completion.",
    )


async def test_streaming_request_errors_before_first_byte_keep_their_status(
    small_context_client: httpx.AsyncClient,
) -> None:
    body = {"text": "x" * 300, "stream": True}
    response = await small_context_client.post("/generate", json=body)
    await assert_400_then_healthy(small_context_client, response, "is longer than the model's")


async def test_batch_with_one_bad_item_is_rejected_whole(
    small_context_client: httpx.AsyncClient,
) -> None:
    body = {"text": ["fine", "x" * 300], "sampling_params": greedy(150)}
    response = await small_context_client.post("/generate", json=body)
    # The good item, submitted first, was aborted: nothing is left running or waiting.
    info = (await small_context_client.get("/get_server_info")).json()
    assert info["internal_states"][0]["running"] == 0
    assert info["internal_states"][0]["waiting"] == 0
    await assert_400_then_healthy(small_context_client, response, "is longer than the model's")


async def test_unknown_route_and_method_are_json_errors(
    small_context_client: httpx.AsyncClient,
) -> None:
    missing = await small_context_client.get("/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    wrong = await small_context_client.get("/generate")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405


async def test_bad_abort_request_body(small_context_client: httpx.AsyncClient) -> None:
    response = await small_context_client.post("/abort_request", json={"abort_all": "yes"})
    await assert_400_then_healthy(small_context_client, response, "abort_all must be a boolean")


async def test_oversized_body_is_413_in_the_error_shape(
    small_context_client: httpx.AsyncClient,
) -> None:
    body = b'{"text": "' + b"x" * (16 * 1024 * 1024) + b'"}'
    response = await small_context_client.post(
        "/generate", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == 413
    assert (await small_context_client.get("/health")).status_code == 200
