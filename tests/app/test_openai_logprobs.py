"""Logprobs on `/v1`: completions' `logprobs` (with and without `echo`) and chat's
`logprobs`/`top_logprobs`, unary and streamed, through the official client on a real socket
and the real model; option checks without one."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from apphelpers import Server, parse_sse
from openaihelpers import chat_body, model_name

from tributary.app.http.errors import InvalidRequest
from tributary.app.openai import parse_chat, parse_completion
from tributary.engine import LogprobRequest

pytest_plugins = ["openaifixtures"]  # model_server, http, aclient

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is 2+2?"}]
GREEDY: dict[str, Any] = {"temperature": 0}
EXACT: dict[str, Any] = {"extra_body": {"ignore_eos": True}}
VOCAB = 1000


# --- options, without a model ---------------------------------------------------------------


def test_completion_logprobs_option() -> None:
    def logprobs(**body: Any) -> LogprobRequest | None:
        return parse_completion({"prompt": "hi", **body}, vocab_size=VOCAB).logprobs

    assert logprobs() is None and logprobs(logprobs=None) is None
    assert logprobs(logprobs=0) == LogprobRequest(start_len=-1, top_n=0)
    assert logprobs(logprobs=5) == LogprobRequest(start_len=-1, top_n=5)
    # SGLang: the prompt is scored only when echo shows it and alternatives are asked for.
    assert logprobs(logprobs=5, echo=True) == LogprobRequest(start_len=0, top_n=5)
    assert logprobs(logprobs=0, echo=True) == LogprobRequest(start_len=-1, top_n=0)
    for bad in (-1, 21, True, "3", 1.5):
        with pytest.raises(InvalidRequest, match="logprobs must be an integer between 0 and 20"):
            logprobs(logprobs=bad)


def test_chat_logprobs_options() -> None:
    def logprobs(**body: Any) -> LogprobRequest | None:
        return parse_chat({"messages": QUESTION, **body}, vocab_size=VOCAB).logprobs

    assert logprobs() is None and logprobs(logprobs=False) is None
    assert logprobs(logprobs=True) == LogprobRequest(start_len=-1, top_n=0)
    assert logprobs(logprobs=True, top_logprobs=20) == LogprobRequest(top_n=20)
    assert logprobs(logprobs=True, top_logprobs=None) == LogprobRequest(top_n=0)
    for without in ({}, {"logprobs": False}):
        with pytest.raises(InvalidRequest, match="only be set when logprobs is true") as info:
            logprobs(top_logprobs=0, **without)
        assert info.value.param == "top_logprobs"
    with pytest.raises(InvalidRequest, match="top_logprobs must be an integer between 0 and 20"):
        logprobs(logprobs=True, top_logprobs=21)
    with pytest.raises(InvalidRequest, match="logprobs must be a boolean"):
        logprobs(logprobs=1)


# --- completions ----------------------------------------------------------------------------


def assert_sorted_tops(tops: list[Any], chosen: list[Any]) -> None:
    """Each top dict is most likely first and its best entry is the chosen token (greedy)."""
    for top, logprob in zip(tops, chosen, strict=True):
        values = list(top.values())
        assert values == sorted(values, reverse=True), top
        assert values[0] == logprob, (top, logprob)
        assert all(v <= 0 for v in values)


@pytest.mark.model
async def test_completion_logprobs_unary_and_stream(
    aclient: openai.AsyncOpenAI, model_server: Server
) -> None:
    name = model_name(model_server)
    unary = await aclient.completions.create(
        model=name, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY, **EXACT
    )
    [choice] = unary.choices
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.tokens) == unary.usage.completion_tokens == 6
    assert "".join(lp.tokens) == choice.text
    # Real offsets into the text (OpenAI's and vLLM's meaning), not SGLang's -1s.
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(6)]
    assert all(len(top) == 3 for top in lp.top_logprobs)  # the chosen token is among them
    assert_sorted_tops(lp.top_logprobs, lp.token_logprobs)

    stream = await aclient.completions.create(
        model=name, prompt=PROMPT, max_tokens=6, logprobs=3, stream=True, **GREEDY, **EXACT
    )
    tokens: list[str] = []
    logprobs: list[float] = []
    offsets: list[int] = []
    text = ""
    async for chunk in stream:
        [c] = chunk.choices
        assert c.logprobs is not None and c.logprobs.tokens is not None
        # A chunk's entries are its own tokens, offsets counted from the choice's start.
        assert c.logprobs.text_offset == [
            len(text) + len("".join(c.logprobs.tokens[:i])) for i in range(len(c.logprobs.tokens))
        ]
        text += c.text
        tokens += c.logprobs.tokens
        logprobs += c.logprobs.token_logprobs or []
        offsets += c.logprobs.text_offset or []
    assert text == choice.text
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert logprobs == pytest.approx(lp.token_logprobs, abs=1e-3)


@pytest.mark.model
async def test_completion_echo_scores_the_prompt(
    aclient: openai.AsyncOpenAI, model_server: Server
) -> None:
    name = model_name(model_server)
    prompt_ids = model_server.eng.tokenize(PROMPT)
    result = await aclient.completions.create(
        model=name, prompt=PROMPT, max_tokens=3, logprobs=2, echo=True, **GREEDY, **EXACT
    )
    [choice] = result.choices
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(prompt_ids) + 3
    assert "".join(lp.tokens) == choice.text
    assert "".join(lp.tokens[: len(prompt_ids)]) == PROMPT
    # Nothing precedes the first prompt token: no logprob, no alternatives.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    # A prompt token need not be the most likely one: its alternatives are the 2 best, plus
    # the token itself when it is not among them (OpenAI's "up to logprobs + 1").
    for token, logprob, top in zip(
        lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True
    ):
        assert top[token] == logprob
        assert len(top) == (2 if list(top).index(token) < 2 else 3)
    assert_sorted_tops(lp.top_logprobs[len(prompt_ids) :], lp.token_logprobs[len(prompt_ids) :])

    stream = await aclient.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=3,
        logprobs=2,
        echo=True,
        stream=True,
        **GREEDY,
        **EXACT,
    )
    chunks = [chunk.choices[0] async for chunk in stream]
    first = chunks[0]
    assert first.text.startswith(PROMPT) and first.logprobs is not None
    assert first.logprobs.tokens is not None and first.logprobs.token_logprobs is not None
    # The prompt's entries come with the first chunk, before its own token's.
    assert len(first.logprobs.tokens) == len(prompt_ids) + 1
    assert first.logprobs.token_logprobs[0] is None
    streamed = [t for c in chunks for t in (c.logprobs.tokens if c.logprobs else None) or []]
    assert streamed == lp.tokens

    # `logprobs: 0` with echo: output entries only (SGLang), placed after the echoed prompt;
    # each "top" holds just the chosen token.
    zero = await aclient.completions.create(
        model=name, prompt=PROMPT, max_tokens=3, logprobs=0, echo=True, **GREEDY, **EXACT
    )
    zlp = zero.choices[0].logprobs
    assert zlp is not None and zlp.tokens and zlp.top_logprobs and zlp.token_logprobs
    assert zlp.tokens == lp.tokens[len(prompt_ids) :]
    assert zlp.text_offset == lp.text_offset[len(prompt_ids) :]
    assert zlp.top_logprobs == [{t: x} for t, x in zip(zlp.tokens, zlp.token_logprobs, strict=True)]


@pytest.mark.model
async def test_text_offsets_are_character_offsets(http: httpx.AsyncClient) -> None:
    """Tokens that split a character (日 and 語 are three tokens each here) show U+FFFD; their
    offsets point at the character they belong to, so offsets index the choice's text."""
    prompt = "Price: 5€ naïve 日本語"
    response = await http.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 2, "logprobs": 1, "echo": True, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    lp = choice["logprobs"]
    tokens = ["Price", ":", " ", "5", "€", " na", "ïve", " \ufffd", "\ufffd", "\ufffd", "本"]
    tokens += ["\ufffd", "\ufffd", "\ufffd"]
    assert lp["tokens"][:14] == tokens
    assert lp["text_offset"][:14] == [0, 5, 6, 7, 8, 9, 12, 15, 16, 16, 17, 18, 18, 18]
    assert lp["text_offset"][14] == len(prompt)  # the first output token
    for offset, token in zip(lp["text_offset"], lp["tokens"], strict=True):
        if "\ufffd" not in token:
            assert choice["text"][offset:].startswith(token)


@pytest.mark.model
async def test_completion_control_tokens(http: httpx.AsyncClient) -> None:
    """Control tokens written in the prompt are in the echoed text; the EOS that ends the
    choice is an entry (it counts as a completion token) placed at the text's end, which does
    not show it."""
    prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    response = await http.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 24, "logprobs": 1, "echo": True, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == 2
    lp = choice["logprobs"]
    assert lp["tokens"][0] == "<|im_start|>" and lp["tokens"][-1] == "<|im_end|>"
    assert len(lp["tokens"]) == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert "".join(lp["tokens"]) == choice["text"] + "<|im_end|>"
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"][-1] == len(choice["text"])


@pytest.mark.model
async def test_forbidden_alternatives_are_finite(http: httpx.AsyncClient) -> None:
    """Under a grammar most alternatives are -inf; JSON has no -Infinity, so they are -9999.0
    (vLLM's floor), on both endpoints."""
    body = {"max_tokens": 3, "temperature": 0, "response_format": {"type": "json_object"}}
    completion = await http.post("/v1/completions", json={"prompt": "JSON:", "logprobs": 5, **body})
    assert completion.status_code == 200, completion.text
    assert "Infinity" not in completion.text
    first_top = completion.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    assert -9999.0 in first_top.values()
    chat = await http.post(
        "/v1/chat/completions",
        json={"messages": QUESTION, "logprobs": True, "top_logprobs": 5, **body},
    )
    assert chat.status_code == 200, chat.text
    assert "Infinity" not in chat.text
    alternatives = chat.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert -9999.0 in [alt["logprob"] for alt in alternatives]


# --- chat -----------------------------------------------------------------------------------


def spelled(entries: list[Any]) -> str:
    return "".join(e.token for e in entries)


@pytest.mark.model
async def test_chat_logprobs_unary_and_stream(
    aclient: openai.AsyncOpenAI, model_server: Server
) -> None:
    name = model_name(model_server)
    unary = await aclient.chat.completions.create(
        model=name, messages=QUESTION, max_tokens=24, logprobs=True, top_logprobs=2, **GREEDY
    )
    [choice] = unary.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == unary.usage.completion_tokens
    for entry in content:
        assert bytes(entry.bytes or []).decode() == entry.token
        assert [alt.logprob for alt in entry.top_logprobs] == sorted(
            (alt.logprob for alt in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.top_logprobs[0].logprob == entry.logprob <= 0
        assert all(bytes(alt.bytes or []).decode() == alt.token for alt in entry.top_logprobs)
    # The EOS that ended the choice is an output token (it counts in completion_tokens), so
    # it has an entry, spelled out, although the text does not show it.
    assert choice.finish_reason == "stop" and choice.matched_stop == 2  # type: ignore[attr-defined]
    assert spelled(content) == choice.message.content + "<|im_end|>"

    stream = await aclient.chat.completions.create(
        model=name,
        messages=QUESTION,
        max_tokens=24,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        **GREEDY,
    )
    streamed: list[Any] = []
    async for chunk in stream:
        [c] = chunk.choices
        if c.logprobs is None:
            assert not c.delta.content  # the role chunk and the finish chunk
            continue
        assert c.logprobs.content is not None
        slice_text = spelled(c.logprobs.content)
        assert slice_text == (c.delta.content or "") or slice_text == "<|im_end|>"
        streamed += c.logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-3)


@pytest.mark.model
async def test_chat_logprobs_without_alternatives(
    http: httpx.AsyncClient, model_server: Server
) -> None:
    body = chat_body(model_server, max_tokens=4, logprobs=True, ignore_eos=True)
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    content = choice["logprobs"]["content"]
    assert [list(e) for e in content] == [["token", "logprob", "bytes", "top_logprobs"]] * 4
    assert all(e["top_logprobs"] == [] for e in content)
    assert "".join(e["token"] for e in content) == choice["message"]["content"]

    plain = await http.post("/v1/chat/completions", json=chat_body(model_server, stream=True))
    events = parse_sse(plain.text)
    assert all(e["choices"][0]["logprobs"] is None for e in events[:-1])


@pytest.mark.model
async def test_bad_logprob_options_are_400s(http: httpx.AsyncClient, model_server: Server) -> None:
    cases = [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs can only be set"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "between 0 and 20"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "between 0 and 20"),
    ]
    for path, extra, text in cases:
        body = chat_body(model_server, **extra)
        if path == "/v1/completions":
            del body["messages"]
        response = await http.post(path, json=body)
        assert response.status_code == 400, response.text
        assert text in json.loads(response.text)["error"]["message"]
    ok = await http.post("/v1/chat/completions", json=chat_body(model_server))
    assert ok.status_code == 200 and "4" in ok.json()["choices"][0]["message"]["content"]
