"""`/tokenize` and `/detokenize` (and their `/v1` paths) over a real Hypercorn socket: shapes
and errors with the sim runner's byte tokenizer (a byte b is token b + 3; 0-2 are special),
and round trips with the real SmolLM2 tokenizer, whose counts match what `/generate` and
`/v1/chat/completions` run."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from apphelpers import Server, running_server, sim_config
from openaihelpers import MODEL_CONFIG, chat_body

from tributary import app
from tributary.app.sglang import tokenize as sglang_tokenize

TOKENIZE = ["/tokenize", "/v1/tokenize"]
DETOKENIZE = ["/detokenize", "/v1/detokenize"]
SIM_VOCAB = 259
SIM_CONTEXT = 4096  # sim_config's


def sim_ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


@pytest.mark.parametrize("path", TOKENIZE)
async def test_tokenize_a_prompt(client: httpx.AsyncClient, path: str) -> None:
    response = await client.post(path, json={"model": "any", "prompt": "hi é"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["tokens", "count", "max_model_len"]
    assert body == {"tokens": sim_ids("hi é"), "count": 5, "max_model_len": SIM_CONTEXT}


@pytest.mark.parametrize("path", TOKENIZE)
async def test_tokenize_a_list_of_prompts(client: httpx.AsyncClient, path: str) -> None:
    response = await client.post(path, json={"prompt": ["hi", "", "abc"]})
    assert response.json() == {
        "tokens": [sim_ids("hi"), [], sim_ids("abc")],
        "count": [2, 0, 3],
        "max_model_len": SIM_CONTEXT,
    }
    empty = await client.post(path, json={"prompt": []})
    assert empty.json() == {"tokens": [], "count": [], "max_model_len": SIM_CONTEXT}


@pytest.mark.parametrize("path", DETOKENIZE)
async def test_detokenize(client: httpx.AsyncClient, path: str) -> None:
    async def text(body: dict[str, Any]) -> Any:
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text
        assert list(response.json()) == ["text"]
        return response.json()["text"]

    assert await text({"tokens": sim_ids("hi é")}) == "hi é"
    assert await text({"tokens": [sim_ids("a"), [], sim_ids("bc")]}) == ["a", "", "bc"]
    assert await text({"tokens": []}) == ""
    # Special tokens (1 is the sim's <|im_start|>) are dropped unless asked for.
    assert await text({"tokens": [1, *sim_ids("x")]}) == "x"
    with_special = {"tokens": [1, *sim_ids("x")], "skip_special_tokens": False}
    assert await text(with_special) == "<|im_start|>x"


async def test_round_trip_through_both_endpoints(client: httpx.AsyncClient) -> None:
    texts = ["plain", "ünïcödé ✓ 日本", "two\nlines"]
    tokens = (await client.post("/tokenize", json={"prompt": texts})).json()["tokens"]
    back = await client.post("/v1/detokenize", json={"tokens": tokens})
    assert back.json() == {"text": texts}


# -- errors ------------------------------------------------------------------------------------

ONE_OF = "Exactly one of 'prompt' or 'messages' must be provided."
NOT_INTS = "Invalid input: 'tokens' must be a list of integers."
SUBLIST = "Invalid input: Sublist in 'tokens' must contain only integers. Found: "

ERROR_CASES: list[tuple[str, str, Any, str, str]] = [
    # (id, path, JSON body, message (or its start, ending in "..."), type)
    ("no-prompt", "/tokenize", {"model": "m"}, ONE_OF, "Bad Request"),
    ("both", "/tokenize", {"prompt": "a", "messages": []}, ONE_OF, "Bad Request"),
    (
        "prompt-int",
        "/tokenize",
        {"prompt": 5},
        "Invalid prompt type: int. Expected str or List[str].",
        "BadRequestError",
    ),
    (
        "prompt-bool",
        "/v1/tokenize",
        {"prompt": True},
        "Invalid prompt type: bool. Expected str or List[str].",
        "BadRequestError",
    ),
    (
        "prompt-list-with-int",
        "/tokenize",
        {"prompt": ["a", 1]},
        "Invalid prompt type: list with int at prompt[1]. Expected str or List[str].",
        "BadRequestError",
    ),
    (
        "add-special-not-bool",
        "/tokenize",
        {"prompt": "a", "add_special_tokens": 1},
        "add_special_tokens must be a boolean, got 1.",
        "Bad Request",
    ),
    (
        "model-not-str",
        "/tokenize",
        {"prompt": "a", "model": 1},
        "model must be a string...",
        "Bad Request",
    ),
    (
        "messages-no-template",
        "/tokenize",
        {"messages": [{"role": "user", "content": "hi"}]},
        "This model has no chat template...",
        "Bad Request",
    ),
    (
        "body-not-object",
        "/tokenize",
        ["hi"],
        "The request body must be a JSON object.",
        "Bad Request",
    ),
    ("no-tokens", "/detokenize", {}, "'tokens' is required...", "Bad Request"),
    (
        "tokens-str",
        "/detokenize",
        {"tokens": "abc"},
        "Invalid tokens type: str. Expected List[int] or List[List[int]].",
        "BadRequestError",
    ),
    ("tokens-strs", "/detokenize", {"tokens": ["a"]}, NOT_INTS, "BadRequestError"),
    ("tokens-mixed", "/v1/detokenize", {"tokens": [104, "a"]}, NOT_INTS, "BadRequestError"),
    ("tokens-bool", "/detokenize", {"tokens": [True]}, NOT_INTS, "BadRequestError"),
    ("tokens-float", "/detokenize", {"tokens": [104, 1.0]}, NOT_INTS, "BadRequestError"),
    ("tokens-null-item", "/detokenize", {"tokens": [104, None]}, NOT_INTS, "BadRequestError"),
    (
        "sublist-str",
        "/detokenize",
        {"tokens": [[104], ["a"]]},
        SUBLIST + '["a"]',
        "BadRequestError",
    ),
    ("sublist-bool", "/detokenize", {"tokens": [[True]]}, SUBLIST + "[true]", "BadRequestError"),
    (
        "sublist-not-list",
        "/detokenize",
        {"tokens": [[104], 105]},
        SUBLIST + "105",
        "BadRequestError",
    ),
    (
        "id-past-vocab",
        "/detokenize",
        {"tokens": [104, SIM_VOCAB]},
        f"Invalid input: tokens[1] is {SIM_VOCAB}, which is not a token id of this model; "
        f"valid ids are in [0, {SIM_VOCAB}).",
        "BadRequestError",
    ),
    (
        "negative-id",
        "/v1/detokenize",
        {"tokens": [-1]},
        f"Invalid input: tokens[0] is -1, which is not a token id of this model; "
        f"valid ids are in [0, {SIM_VOCAB}).",
        "BadRequestError",
    ),
    (
        "huge-id-in-sublist",
        "/detokenize",
        {"tokens": [[104], [104, 10**30]]},
        f"Invalid input: tokens[1][1] is {10**30}, which is not a token id of this model; "
        f"valid ids are in [0, {SIM_VOCAB}).",
        "BadRequestError",
    ),
    (
        "skip-special-not-bool",
        "/detokenize",
        {"tokens": [104], "skip_special_tokens": "no"},
        "skip_special_tokens must be a boolean, got 'no'.",
        "Bad Request",
    ),
]


def assert_sglang_error(response: httpx.Response, status: int, message: str, err_type: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["object", "message", "type", "param", "code"]
    assert body["object"] == "error" and body["code"] == status and body["type"] == err_type
    if message.endswith("..."):
        assert body["message"].startswith(message[:-3]), body["message"]
    else:
        assert body["message"] == message


async def assert_still_serving(client: httpx.AsyncClient) -> None:
    ok = await client.post("/tokenize", json={"prompt": "ok"})
    assert ok.status_code == 200 and ok.json()["tokens"] == sim_ids("ok")
    back = await client.post("/detokenize", json={"tokens": sim_ids("ok")})
    assert back.status_code == 200 and back.json() == {"text": "ok"}


@pytest.mark.parametrize(
    ("path", "body", "message", "err_type"),
    [case[1:] for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
async def test_bad_request_is_a_400_and_the_server_keeps_serving(
    client: httpx.AsyncClient, path: str, body: Any, message: str, err_type: str
) -> None:
    assert_sglang_error(await client.post(path, json=body), 400, message, err_type)
    await assert_still_serving(client)


@pytest.mark.parametrize("path", [*TOKENIZE, *DETOKENIZE])
async def test_invalid_json_is_a_400(client: httpx.AsyncClient, path: str) -> None:
    response = await client.post(
        path, content=b'{"prompt": ', headers={"Content-Type": "application/json"}
    )
    assert_sglang_error(response, 400, "Invalid JSON in the request body: ...", "Bad Request")
    await assert_still_serving(client)


async def test_messages_keys_this_server_cannot_honour_are_refused(
    client: httpx.AsyncClient,
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for key, value in [("tools", [{"type": "function"}]), ("continue_final_message", True)]:
        response = await client.post("/tokenize", json={"messages": messages, key: value})
        message = f"{key} is not supported by this server yet."
        assert_sglang_error(response, 400, message, "Bad Request")
    await assert_still_serving(client)


@pytest.mark.parametrize(
    ("path", "body", "helper"),
    [
        ("/tokenize", {"prompt": "hi"}, "tokenize_all"),
        ("/detokenize", {"tokens": [104]}, "detokenize_all"),
    ],
)
async def test_an_unexpected_error_is_a_500_logged_as_before(
    client: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    path: str,
    body: Any,
    helper: str,
) -> None:
    """Logged with the line log filters know (the one before the blueprints shared their
    error handlers), not the request's method and path."""

    async def failing(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("tokenizer bug")

    monkeypatch.setattr(sglang_tokenize, helper, failing)
    with caplog.at_level(logging.ERROR, logger="tributary.app"):
        response = await client.post(path, json=body)
    message = "Internal server error: RuntimeError"
    assert_sglang_error(response, 500, message, "InternalServerError")
    [logged] = [r for r in caplog.records if r.name == "tributary.app"]
    assert logged.getMessage() == "unhandled error in tokenize/detokenize"
    assert logged.exc_info is not None and logged.exc_info[0] is RuntimeError


async def test_api_key_applies() -> None:
    settings = app.ServerSettings(port=0, graceful_timeout=1.0, api_key="sekrit")
    async with running_server(sim_config(), settings) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            for path, body in [
                ("/tokenize", {"prompt": "hi"}),
                ("/v1/tokenize", {"prompt": "hi"}),
                ("/detokenize", {"tokens": sim_ids("hi")}),
                ("/v1/detokenize", {"tokens": sim_ids("hi")}),
            ]:
                denied = await client.post(path, json=body)
                assert denied.status_code == 401, path
                assert_sglang_error(denied, 401, "Incorrect API key provided.", "401")
                wrong = await client.post(path, json=body, headers={"Authorization": "Bearer x"})
                assert wrong.status_code == 401, path
                good = {"Authorization": "Bearer sekrit"}
                allowed = await client.post(path, json=body, headers=good)
                assert allowed.status_code == 200, path


# -- the real tokenizer ------------------------------------------------------------------------


@pytest.fixture
async def model_server() -> AsyncIterator[Server]:
    async with running_server(MODEL_CONFIG) as server:
        yield server


SMOL_TEXTS = [
    "The capital of France is",
    "  leading spaces, tabs\tand\nnew lines  ",
    "Ünïcödé: naïve café, 日本語, emoji 🙂✓",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.mark.model
async def test_smollm2_round_trips_and_counts_match_generation(model_server: Server) -> None:
    vocab = model_server.eng.model_info.vocab_size
    async with httpx.AsyncClient(base_url=model_server.url, timeout=60) as client:
        listed = (await client.post("/tokenize", json={"prompt": SMOL_TEXTS})).json()
        assert listed["max_model_len"] == 2048
        assert listed["count"] == [len(ids) for ids in listed["tokens"]]
        back = await client.post("/detokenize", json={"tokens": listed["tokens"]})
        assert back.json() == {"text": SMOL_TEXTS}
        for text, ids in zip(SMOL_TEXTS, listed["tokens"], strict=True):
            single = (await client.post("/v1/tokenize", json={"prompt": text})).json()
            assert single == {"tokens": ids, "count": len(ids), "max_model_len": 2048}
            generate = {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            generated = await client.post("/generate", json=generate)
            assert generated.json()["meta_info"]["prompt_tokens"] == single["count"]
            text_back = await client.post("/v1/detokenize", json={"tokens": ids})
            assert text_back.json() == {"text": text}

        past_vocab = await client.post("/detokenize", json={"tokens": [28, vocab]})
        message = (
            f"Invalid input: tokens[1] is {vocab}, which is not a token id of this model; "
            f"valid ids are in [0, {vocab})."
        )
        assert_sglang_error(past_vocab, 400, message, "BadRequestError")
        assert (await client.post("/detokenize", json={"tokens": [28]})).status_code == 200


@pytest.mark.model
async def test_smollm2_messages_give_the_chat_prompt(model_server: Server) -> None:
    async with httpx.AsyncClient(base_url=model_server.url, timeout=60) as client:
        chat = chat_body(model_server, max_tokens=1)
        tokenized = (await client.post("/tokenize", json={"messages": chat["messages"]})).json()
        completion = await client.post("/v1/chat/completions", json=chat)
        assert completion.json()["usage"]["prompt_tokens"] == tokenized["count"]
        assert tokenized["count"] == len(tokenized["tokens"])

        raw = await client.post(
            "/detokenize", json={"tokens": tokenized["tokens"], "skip_special_tokens": False}
        )
        assert raw.json()["text"].endswith(
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        )
        assert raw.json()["text"].startswith("<|im_start|>system\n")
        plain = await client.post("/detokenize", json={"tokens": tokenized["tokens"]})
        assert "<|im_start|>" not in plain.json()["text"]
        assert plain.json()["text"].endswith("user\nWhat is 2+2?\nassistant\n")

        no_prompt = {"messages": chat["messages"], "add_generation_prompt": False}
        without = (await client.post("/v1/tokenize", json=no_prompt)).json()
        assert tokenized["tokens"][: without["count"]] == without["tokens"]
        suffix = tokenized["tokens"][without["count"] :]
        text = await client.post(
            "/detokenize", json={"tokens": suffix, "skip_special_tokens": False}
        )
        assert text.json() == {"text": "<|im_start|>assistant\n"}

        bad = await client.post("/tokenize", json={"messages": [{"role": "robot", "content": "x"}]})
        assert_sglang_error(bad, 400, "messages[0].role must be one of...", "Bad Request")
        assert bad.json()["param"] == "messages[0].role"
        again = await client.post("/tokenize", json={"messages": chat["messages"]})
        assert again.json() == tokenized
