"""SamplingParams: SGLang's defaults, normalization and validation messages."""

from __future__ import annotations

import pytest

from tributary.engine import InvalidSamplingParams, SamplingParams
from tributary.engine.sampling import TOP_K_ALL

VOCAB = 49152


def test_defaults_match_sglang() -> None:
    p = SamplingParams.from_dict(None)
    assert p.max_new_tokens == 128 and p.temperature == 1.0 and p.top_p == 1.0
    assert p.top_k == TOP_K_ALL and p.min_p == 0.0 and p.n == 1
    assert p.skip_special_tokens and not p.ignore_eos and not p.no_stop_trim
    assert SamplingParams.from_dict({}) == p


def test_null_resets_default_but_max_new_tokens_null_means_unbounded() -> None:
    p = SamplingParams.from_dict({"temperature": None, "top_k": None, "max_new_tokens": None})
    assert p.temperature == 1.0 and p.top_k == TOP_K_ALL
    assert p.max_new_tokens is None


def test_greedy_rewrite_and_top_k_minus_one() -> None:
    p = SamplingParams.from_dict({"temperature": 0})
    assert p.greedy and p.temperature == 1.0 and p.top_k == 1
    assert SamplingParams.from_dict({"top_k": -1}).top_k == TOP_K_ALL


def test_stop_forms() -> None:
    assert SamplingParams.from_dict({"stop": "\n"}).stop == ("\n",)
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ("a", "b")
    p = SamplingParams.from_dict({"stop_token_ids": [5, None, 7]})
    assert p.stop_token_ids == frozenset({5, 7})


@pytest.mark.parametrize(
    ("value", "patterns"),
    [
        (r"\d+", (r"\d+",)),
        ([r"\d", "[.!?]"], (r"\d", "[.!?]")),
        ([], ()),  # what SGLang's frontend always sends
        (None, ()),
        ("", ()),
        (["", "x"], ("x",)),
    ],
)
def test_stop_regex_forms(value: object, patterns: tuple[str, ...]) -> None:
    p = SamplingParams.from_dict({"stop_regex": value})
    assert p.stop_regex == patterns
    p.verify(VOCAB)
    assert [c.pattern for c in p.stop_regex_patterns] == list(patterns)


def test_stop_regex_is_compiled_once_and_stays_out_of_equality() -> None:
    p = SamplingParams.from_dict({"stop_regex": "a+"})
    p.verify(VOCAB)
    assert p.stop_regex_patterns is p.stop_regex_patterns
    assert p == SamplingParams.from_dict({"stop_regex": ["a+"]})  # this one never compiled
    assert p.stop_regex_patterns[0].search("baa").group() == "aa"
    assert (
        SamplingParams.from_dict({"stop_regex": [f"x{i}" for i in range(32)]}).verify(VOCAB) is None
    )


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": -0.5}, "temperature must be a non-negative finite number, got -0.5."),
        (
            {"temperature": float("inf")},
            "temperature must be a non-negative finite number, got inf.",
        ),
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
        ({"min_new_tokens": -1}, "min_new_tokens must be in [0, max_new_tokens], got -1."),
        ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
        (
            {"max_new_tokens": 4, "min_new_tokens": 5},
            "min_new_tokens must be in [0, max_new_tokens(4)], got 5.",
        ),
        ({"logit_bias": {"49152": 1.0}}, "logit_bias must has keys in [0, 49151], got 49152."),
        ({"stop_token_ids": [2, 10**9]}, "stop_token_ids must be in [0, 49151], got 1000000000."),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be in [0, 49151], got -1."),
        (
            {"regex": "a+", "ebnf": "x"},
            "Only one of json_schema, regex, ebnf, or structural_tag can be set.",
        ),
        ({"structural_tag": "{}"}, "structural_tag is not supported by this server yet."),
        (
            {"stop_regex": [f"x{i}" for i in range(33)]},
            "at most 32 stop_regex patterns are allowed, got 33",
        ),
        # 129 characters, 258 bytes: the limit counts UTF-8 bytes.
        ({"stop_regex": "é" * 129}, "stop_regex is 258 bytes, over the 256-byte limit"),
        ({"stop_regex": ["ok", "a("]}, "invalid stop_regex 'a(': missing ) at position 2"),
        ({"stop_regex": "[z-a]"}, "invalid stop_regex '[z-a]': bad character range at position 4"),
    ],
)
def test_verify_messages(params: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams.from_dict(params).verify(VOCAB)
    assert info.value.message == message
    assert info.value.http_status == 400


def test_verify_again_rechecks_a_changed_logit_bias() -> None:
    """The verify memo does not cover `logit_bias`, a dict that can change after a verify."""
    p = SamplingParams.from_dict({"logit_bias": {"5": 1.0}})
    p.verify(100)
    p.verify(100)  # memo hit: still fine
    p.logit_bias[1_000_000] = 1.0  # type: ignore[index]
    with pytest.raises(InvalidSamplingParams) as info:
        p.verify(100)
    assert info.value.message == "logit_bias must has keys in [0, 99], got 1000000."


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"temperatur": 0.5}, "unknown field `temperatur`"),
        ({"max_new_tokens": "ten"}, "max_new_tokens must be an integer"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"ignore_eos": 1}, "ignore_eos must be a boolean"),
        ({"stop": 5}, "stop must be a string or a list of strings"),
        ({"stop_regex": 5}, "stop_regex must be a string or a list of strings"),
        ({"stop_regex": ["a", 1]}, "stop_regex must be a string or a list of strings"),
        ({"stop_token_ids": "2"}, "stop_token_ids must be a list of integers"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
    ],
)
def test_wrong_keys_and_types_are_rejected(params: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidSamplingParams, match=fragment.replace("(", r"\(")):
        SamplingParams.from_dict(params)
