"""SGLang's GenerateReqInput normalization, as pure functions (no server)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tributary.app import sglang
from tributary.engine import BadRequest, InvalidSamplingParams


def normalize(body: Any) -> sglang.NormalizedGenerate:
    return sglang.normalize_generate(body, vocab_size=259)


def test_single_text() -> None:
    req = normalize({"text": "hi", "rid": "r", "sampling_params": {"max_new_tokens": 3}})
    assert not req.is_batch and not req.stream
    (item,) = req.items
    assert item.text == "hi" and item.rid == "r" and item.sampling.max_new_tokens == 3


def test_defaults() -> None:
    (item,) = normalize({"text": "hi"}).items
    assert item.rid is None  # the engine makes a uuid
    assert item.sampling.max_new_tokens == 128 and item.sampling.temperature == 1.0


def test_batch_with_str_rid_fans_out() -> None:
    req = normalize({"text": ["a", "b", "c"], "rid": "job"})
    assert req.is_batch
    assert [i.rid for i in req.items] == ["job_0", "job_1", "job_2"]
    assert [i.text for i in req.items] == ["a", "b", "c"]


def test_batch_rid_list_and_per_item_sampling() -> None:
    body = {
        "input_ids": [[5], [6, 7]],
        "rid": ["x", "y"],
        "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
    }
    req = normalize(body)
    assert [(i.input_ids, i.rid, i.sampling.max_new_tokens) for i in req.items] == [
        ([5], "x", 1),
        ([6, 7], "y", 2),
    ]


def test_n_is_prompt_major_and_regenerates_rids() -> None:
    body = {"text": ["p0", "p1"], "rid": ["a", "b"], "sampling_params": {"n": 3}}
    req = normalize(body)
    assert [i.text for i in req.items] == ["p0"] * 3 + ["p1"] * 3
    rids = [i.rid for i in req.items]
    assert len(set(rids)) == 6 and not {"a", "b"} & set(rids)
    assert all(i.sampling.n == 1 for i in req.items)  # each sample is one engine request


def test_single_prompt_with_n_becomes_a_batch() -> None:
    req = normalize({"text": "hi", "sampling_params": {"n": 2}, "stream": True})
    assert req.is_batch and req.stream and len(req.items) == 2


def test_text_and_input_ids_together_use_the_ids() -> None:
    (item,) = normalize({"text": "hi", "input_ids": [9, 10]}).items
    assert item.input_ids == [9, 10]
    req = normalize({"text": ["a", "b"], "input_ids": [[5], [6]]})
    assert req.is_batch and [i.input_ids for i in req.items] == [[5], [6]]


def test_greedy_and_null_rules_come_from_sampling_params() -> None:
    (item,) = normalize({"text": "x", "sampling_params": {"temperature": 0, "top_p": None}}).items
    assert item.sampling.top_k == 1 and item.sampling.top_p == 1.0
    (item,) = normalize({"text": "x", "sampling_params": {"max_new_tokens": None}}).items
    assert item.sampling.max_new_tokens is None


def test_unknown_top_level_keys_are_ignored() -> None:
    assert len(normalize({"text": "x", "whatever": {"a": 1}, "log_metrics": False}).items) == 1


@pytest.mark.parametrize(
    "body",
    [
        {"text": "x", "sampling_params": {"bogus": 1}},
        {"text": "x", "sampling_params": {"temperature": "hot"}},
        {"text": "x", "sampling_params": {"top_p": 0}},
    ],
)
def test_sampling_errors_are_invalid_sampling_params(body: Any) -> None:
    with pytest.raises(InvalidSamplingParams):
        normalize(body)


def test_errors_are_bad_requests_with_status_400() -> None:
    with pytest.raises(BadRequest) as info:
        normalize({"text": ["a"], "rid": ["x", "y"]})
    assert info.value.http_status == 400


@given(
    texts=st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=4),
    n=st.integers(min_value=1, max_value=3),
    rid=st.one_of(st.none(), st.text(min_size=1, max_size=3)),
    stream=st.booleans(),
)
def test_batch_expansion_is_prompt_major_with_sglang_rids(
    texts: list[str], n: int, rid: str | None, stream: bool
) -> None:
    body = {"text": texts, "rid": rid, "stream": stream, "sampling_params": {"n": n}}
    req = normalize(body)
    assert req.is_batch and req.stream == stream
    assert [i.text for i in req.items] == [t for t in texts for _ in range(n)]
    rids = [i.rid for i in req.items]
    if n > 1:
        assert len(set(rids)) == len(rids) and all(r and len(r) == 32 for r in rids)
    elif rid is None:
        assert rids == [None] * len(texts)
    else:
        assert rids == [f"{rid}_{i}" for i in range(len(texts))]
