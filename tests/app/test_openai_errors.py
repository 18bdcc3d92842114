"""`/v1` errors: OpenAI's body shape and status for each bad request, and the server keeps
serving after each. Real model for request errors; the sim runner for "no chat template";
a scripted engine for failures the engines only produce under fault."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from apphelpers import (
    ScriptedEngine,
    Server,
    parse_sse,
    running_server,
    server_settings,
    sim_config,
    wait_until,
)
from openaihelpers import chat_body, model_name

from tributary import app
from tributary.engine import Done, Error, Frame, GenerateRequest, RunnerFailure, SamplingParams

pytest_plugins = ["openaifixtures"]  # model_server, http, aclient

LONG = "hello " * 3000  # about 3000 tokens; the test context is 2048


def assert_openai_error(response: httpx.Response, status: int, *, contains: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert contains in error["message"], error["message"]
    return dict(error)


async def assert_still_serving(http: httpx.AsyncClient, server: Server) -> None:
    ok = await http.post("/v1/chat/completions", json=chat_body(server))
    assert ok.status_code == 200, ok.text
    assert "4" in ok.json()["choices"][0]["message"]["content"]


CHAT_CASES: list[tuple[str, dict[str, Any], int, str, str | None]] = [
    # (id, changes to a valid chat body (None value: remove the key), status, text, param)
    ("missing-messages", {"messages": None}, 400, "messages is required", "messages"),
    ("empty-messages", {"messages": []}, 400, "non-empty list", "messages"),
    (
        "wrong-role",
        {"messages": [{"role": "robot", "content": "hi"}]},
        400,
        "role must be one of 'system', 'developer', 'user', 'assistant'",
        "messages[0].role",
    ),
    (
        "image-part",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "only text is supported",
        "messages[0].content",
    ),
    ("unknown-model", {"model": "gpt-4o"}, 404, "The model `gpt-4o` does not exist.", "model"),
    (
        "prompt-longer-than-context",
        {"messages": [{"role": "user", "content": LONG}]},
        400,
        "is longer than the model's context length (2048 tokens)",
        None,
    ),
    (
        "prompt-longer-than-context-stream",
        {"messages": [{"role": "user", "content": LONG}], "stream": True},
        400,
        "is longer than the model's context length (2048 tokens)",
        None,
    ),
    (
        "max-tokens-beyond-context",
        {"max_tokens": 5000},
        400,
        "max_completion_tokens is too large: 5000. This model supports at most 2048",
        "max_tokens",
    ),
    (
        "max-tokens-beside-prompt",
        {"max_tokens": 2040},
        400,
        "Requested token count exceeds the model's maximum context length of 2048",
        None,
    ),
    ("bad-temperature", {"temperature": -1}, 400, "temperature must be a non-negative", None),
    ("tools", {"tools": [{"type": "function", "function": {}}]}, 400, "function.name", "tools"),
    ("bad-stream-options", {"stream_options": {"include_usage": True}}, 400, "stream", None),
]


@pytest.mark.model
@pytest.mark.parametrize(
    ("changes", "status", "text", "param"),
    [case[1:] for case in CHAT_CASES],
    ids=[case[0] for case in CHAT_CASES],
)
async def test_chat_errors(
    http: httpx.AsyncClient,
    model_server: Server,
    changes: dict[str, Any],
    status: int,
    text: str,
    param: str | None,
) -> None:
    body = chat_body(model_server)
    for key, value in changes.items():
        if value is None:
            del body[key]
        else:
            body[key] = value
    error = assert_openai_error(
        await http.post("/v1/chat/completions", json=body), status, contains=text
    )
    if param is not None:
        assert error["param"] == param
    if status == 404:
        assert error["type"] == "invalid_request_error" and error["code"] == "model_not_found"
    if "context length" in text:
        assert error["code"] == "context_length_exceeded"
    assert model_server.eng.stats().running == 0
    await assert_still_serving(http, model_server)


COMPLETION_CASES: list[tuple[str, Any, int, str]] = [
    ("empty-string", {"prompt": ""}, 400, "prompt cannot be empty"),
    ("empty-list", {"prompt": []}, 400, "prompt cannot be empty"),
    ("empty-token-list", {"prompt": [[1, 2], []]}, 400, "prompt cannot be empty"),
    ("missing-prompt", {}, 400, "prompt is required"),
    ("mixed-prompt", {"prompt": ["a", 1]}, 400, "prompt must be a string"),
    ("unknown-model", {"prompt": "hi", "model": "nope"}, 404, "The model `nope` does not exist."),
    ("out-of-vocabulary", {"prompt": [10**9]}, 400, "out-of-vocabulary"),
    ("logprobs-too-many", {"prompt": "hi", "logprobs": 21}, 400, "between 0 and 20"),
    ("not-an-object", ["hi"], 400, "must be a JSON object"),
]


@pytest.mark.model
@pytest.mark.parametrize(
    ("body", "status", "text"),
    [case[1:] for case in COMPLETION_CASES],
    ids=[case[0] for case in COMPLETION_CASES],
)
async def test_completion_errors(
    http: httpx.AsyncClient, model_server: Server, body: Any, status: int, text: str
) -> None:
    if isinstance(body, dict) and "model" not in body:
        body = {"model": model_name(model_server), **body}
    response = await http.post("/v1/completions", json=body)
    assert_openai_error(response, status, contains=text)
    await assert_still_serving(http, model_server)


@pytest.mark.model
async def test_invalid_json_and_wrong_method(http: httpx.AsyncClient, model_server: Server) -> None:
    response = await http.post("/v1/chat/completions", content=b'{"messages": [')
    assert_openai_error(response, 400, contains="Invalid JSON")
    response = await http.get("/v1/chat/completions")
    assert response.status_code == 405
    response = await http.get("/v1/models/other-model")
    assert_openai_error(response, 404, contains="The model `other-model` does not exist.")
    await assert_still_serving(http, model_server)


@pytest.mark.model
async def test_openai_client_raises_typed_errors(model_server: Server) -> None:
    client = openai.AsyncOpenAI(
        base_url=model_server.url + "/v1", api_key="none", max_retries=0, timeout=60
    )
    async with client:
        with pytest.raises(openai.NotFoundError) as not_found:
            await client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
            )
        assert not_found.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.chat.completions.create(
                model=model_name(model_server),
                messages=[{"role": "user", "content": LONG}],
                stream=True,
            )
        assert "is longer than the model's context length" in too_long.value.message
        ok = await client.completions.create(
            model=model_name(model_server), prompt="1, 2, 3,", max_tokens=3, temperature=0
        )
        assert "4" in ok.choices[0].text


async def test_no_chat_template_is_a_clear_400(sim_server: Server) -> None:
    """The sim runner's model has no chat template: chat refuses, completions still work."""
    async with httpx.AsyncClient(base_url=sim_server.url, timeout=30) as client:
        body = {"model": model_name(sim_server), "messages": [{"role": "user", "content": "hi"}]}
        error = assert_openai_error(
            await client.post("/v1/chat/completions", json=body),
            400,
            contains="has no chat template",
        )
        assert error["type"] == "invalid_request_error" and error["param"] == "messages"
        ok = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert ok.status_code == 200
        assert ok.json()["usage"]["completion_tokens"] == 3


async def test_queue_full_is_a_503_with_retry_after() -> None:
    # Two slots, no queue, one slot busy: the first choice takes the free slot, the second
    # has nowhere to wait.
    config = sim_config(max_running_requests=2, max_queued_requests=0)
    async with running_server(config) as server:
        busy = server.eng.submit(
            GenerateRequest(
                text="busy", sampling=SamplingParams.from_dict({"max_new_tokens": 3000})
            )
        )
        await wait_until(lambda: server.eng.stats().running == 1)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            response = await client.post("/v1/completions", json={"prompt": "hi", "n": 2})
            error = assert_openai_error(response, 503, contains="queue is full")
            assert error["message"] == "The request queue is full."  # SGLang's words
            assert error["type"] == "server_error"
            assert response.headers["retry-after"] == "1"
            assert server.eng.stats().waiting == 0  # all or nothing: no choice was submitted
            assert server.eng.stats().running == 1
        busy.close()


# -- failures after submit (scripted engine) ----------------------------------------------------


def frame(rid: str, text: str, n: int) -> Frame:
    return Frame(rid, text, [n], 3, n, 0)


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[ScriptedEngine, str]]:
    def script(i: int, rid: str) -> list[Any]:
        if i == 0:  # fails mid-stream
            return [frame(rid, "a", 1), Error(rid, RunnerFailure("llama_decode failed"))]
        if i == 1:  # a scheduler rejection carrying a status
            abort = {"type": "abort", "message": "queue timeout", "status_code": 503}
            return [Done(rid, "", [], 3, 0, 0, abort)]
        # aborted without a status (client abort, /abort_request): an ordinary finish
        return [frame(rid, "b", 1), Done(rid, "", [], 3, 1, 0, {"type": "abort"})]

    eng = ScriptedEngine(script)
    flask_app = app.create_app(eng, server_settings())  # type: ignore[arg-type]
    async with app.open_http_server(flask_app, server_settings()) as urls:
        yield eng, urls[0]


async def test_failures_after_submit(scripted: tuple[ScriptedEngine, str]) -> None:
    eng, url = scripted
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        body = {"prompt": "x", "stream": True}
        events = parse_sse((await client.post("/v1/completions", json=body)).text)
        assert events[0]["choices"][0]["text"] == "a"
        assert events[1] == {
            "error": {
                "message": "llama_decode failed",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
        assert events[2:] == ["[DONE]"]

        response = await client.post("/v1/completions", json={"prompt": "x"})
        assert_openai_error(response, 503, contains="queue timeout")

        response = await client.post("/v1/chat/completions", json={"messages": []})
        assert response.status_code == 400
        response = await client.post("/v1/completions", json={"prompt": "x"})
        choice = response.json()["choices"][0]
        assert choice["text"] == "b" and choice["finish_reason"] == "abort"
    assert len(eng.requests) == 3


async def test_openai_client_raises_on_a_mid_stream_error(
    scripted: tuple[ScriptedEngine, str],
) -> None:
    _, url = scripted
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        stream = await client.completions.create(model="scripted", prompt="x", stream=True)
        texts = []
        with pytest.raises(openai.APIError, match="llama_decode failed"):
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
        assert texts == ["a"]
