"""Parsing `/v1` bodies: OpenAI's options land on the right SGLang sampling parameters, and
bad bodies are refused before anything is submitted."""

from __future__ import annotations

from typing import Any

import pytest

from tributary.app.http.errors import InvalidRequest
from tributary.app.openai import parse_chat, parse_completion
from tributary.engine import BadRequest, InvalidSamplingParams

VOCAB = 1000
USER = [{"role": "user", "content": "hi"}]


def completion(**body: Any) -> Any:
    return parse_completion({"prompt": "hi", **body}, vocab_size=VOCAB)


def chat(**body: Any) -> Any:
    return parse_chat({"messages": USER, **body}, vocab_size=VOCAB)


def test_defaults() -> None:
    req = completion()
    assert req.sampling.max_new_tokens == 16  # OpenAI's completions default
    assert req.n == 1 and not req.stream and not req.include_usage and not req.echo
    assert req.model is None and req.rid is None
    assert chat().sampling.max_new_tokens is None  # chat: until the context is full
    assert completion(max_tokens=None).sampling.max_new_tokens is None


def test_openai_options_map_to_sampling_params() -> None:
    req = completion(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        n=3,
        stop=["\n", "x"],
        seed=42,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        logit_bias={"5": -100},
        min_tokens=2,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        ignore_eos=True,
        stop_token_ids=[9],
        skip_special_tokens=False,
        no_stop_trim=True,
        user="someone",
    )
    s = req.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.sampling_seed) == (7, 0.5, 0.9, 42)
    assert s.stop == ("\n", "x") and s.stop_token_ids == frozenset({9})
    assert (s.presence_penalty, s.frequency_penalty, s.min_new_tokens) == (0.1, 0.2, 2)
    assert dict(s.logit_bias) == {5: -100.0}
    assert (s.top_k, s.min_p, s.repetition_penalty) == (20, 0.05, 1.1)
    assert s.ignore_eos and not s.skip_special_tokens and s.no_stop_trim
    assert req.n == 3 and s.n == 1  # each choice is its own engine request


def test_chat_max_completion_tokens_wins() -> None:
    assert chat(max_tokens=5).sampling.max_new_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).sampling.max_new_tokens == 9


def test_greedy_temperature_zero() -> None:
    assert completion(temperature=0).sampling.greedy


def test_prompt_shapes() -> None:
    assert completion(prompt="a").prompts == ["a"]
    assert completion(prompt=["a", "b"]).prompts == ["a", "b"]
    assert completion(prompt=[1, 2]).prompts == [[1, 2]]
    assert completion(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    for bad in ("", [], [""], [[]], ["a", 1], [[1], "a"], 5, [True]):
        with pytest.raises(InvalidRequest) as info:
            completion(prompt=bad)
        assert info.value.param == "prompt"


def test_stream_options() -> None:
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True, stream_options={}).include_usage
    with pytest.raises(InvalidRequest, match="only be set when stream is true"):
        completion(stream_options={"include_usage": True})
    with pytest.raises(InvalidRequest, match="stream must be a boolean"):
        completion(stream="yes")


def test_messages() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = chat(
        messages=[
            {"role": "system", "content": "s"},
            {"role": "user", "content": parts, "name": "bob"},
            {"role": "assistant", "content": "c"},
        ]
    )
    assert req.messages == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a\nb", "name": "bob"},
        {"role": "assistant", "content": "c"},
    ]
    bad_messages: list[Any] = [
        None,
        [],
        "hi",
        [{"content": "no role"}],
        [{"role": "tool", "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
        [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}],
    ]
    for messages in bad_messages:
        with pytest.raises(InvalidRequest):
            parse_chat({"messages": messages}, vocab_size=VOCAB)


def test_unsupported_features_are_refused() -> None:
    for body in ({"suffix": "x"}, {"best_of": 2}):
        with pytest.raises(InvalidRequest, match="not supported"):
            completion(**body)
    for body in (
        {"functions": [{"name": "f"}]},
        {"response_format": {"type": "structural_tag"}},
    ):
        with pytest.raises(InvalidRequest, match="not supported"):
            chat(**body)
    # Values that ask for nothing special are accepted.
    chat(tools=[], tool_choice="none", response_format={"type": "text"}, logprobs=False)
    completion(best_of=1, suffix="")


def test_engine_validation_applies() -> None:
    with pytest.raises(InvalidSamplingParams, match="temperature"):
        completion(temperature=-1)
    with pytest.raises(InvalidSamplingParams, match="n must be at least 1"):
        completion(n=0)
    with pytest.raises(InvalidSamplingParams, match="logit_bias"):
        completion(logit_bias={str(VOCAB): 1})
    with pytest.raises(BadRequest, match="max_tokens must be at least 0"):
        completion(max_tokens=-1)
    assert completion(max_tokens=0).sampling.max_new_tokens == 0  # with echo: the prompt
    with pytest.raises(BadRequest, match="must be a JSON object"):
        parse_completion(["hi"], vocab_size=VOCAB)


def test_developer_role_is_the_system_role() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ]
    }
    messages = parse_chat(body, vocab_size=49152).messages
    assert [m["role"] for m in messages] == ["system", "user"]
