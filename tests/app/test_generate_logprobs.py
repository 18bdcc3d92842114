"""`/generate` logprobs with the real model, as SGLang's own endpoint tests ask for them
(contract section 9, items 4-8, 17 and 21; /tmp/research/sglang_compat.md section 6):
`return_logprob`, `logprob_start_len`, `top_logprobs_num`, `token_ids_logprob` and
`return_text_in_logprobs`, unary, batched, with n > 1, and in both streaming modes."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
from apphelpers import META_KEYS, wait_until
from sglangfixtures import (
    Model,
    generate,
    model_fixture,  # noqa: F401  (the `model` fixture)
    sglang_post,
    stream_frames,
)

pytestmark = pytest.mark.model

#: meta_info keys with `return_logprob`, then with `top_logprobs_num`, then with
#: `token_ids_logprob`, in SGLang's order.
LOGPROB_KEYS = ["input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"]
TOP_KEYS = ["input_top_logprobs", "output_top_logprobs"]
IDS_KEYS = ["input_token_ids_logprobs", "output_token_ids_logprobs"]
ALL_LOGPROB_KEYS = {*LOGPROB_KEYS, *TOP_KEYS, *IDS_KEYS}

CAPITAL = "The capital of France is"


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **extra}


def check_entry(entry: list[Any], *, text: bool) -> None:
    """`[logprob, token_id, text|null]`."""
    assert len(entry) == 3, entry
    logprob, token, token_text = entry
    assert isinstance(logprob, float) and logprob <= 0, entry
    assert isinstance(token, int)
    assert isinstance(token_text, str) if text else token_text is None


def check_top(entries: list[list[Any]], n: int, *, text: bool) -> None:
    assert len(entries) == n
    for entry in entries:
        check_entry(entry, text=text)
    logprobs = [e[0] for e in entries]
    assert logprobs == sorted(logprobs, reverse=True)
    assert len({e[1] for e in entries}) == n
    assert sum(math.exp(lp) for lp in logprobs) <= 1 + 1e-4


async def test_04_top5_with_text(model: Model) -> None:
    body = {
        "text": CAPITAL,
        "sampling_params": greedy(16),
        "return_logprob": True,
        "top_logprobs_num": 5,
        "return_text_in_logprobs": True,
        "logprob_start_len": 0,
    }
    obj = await generate(model.client, body)
    meta = obj["meta_info"]
    assert list(meta) == [*META_KEYS, *LOGPROB_KEYS, *TOP_KEYS, "e2e_latency"]
    eng = model.server.eng

    itl = meta["input_token_logprobs"]
    assert [x[1] for x in itl] == model.tokenize(CAPITAL) and len(itl) == meta["prompt_tokens"]
    assert itl[0][0] is None and isinstance(itl[0][2], str)
    for entry in itl[1:]:
        check_entry(entry, text=True)
    assert "".join(x[2] for x in itl) == CAPITAL

    otl = meta["output_token_logprobs"]
    assert [x[1] for x in otl] == obj["output_ids"]
    assert len(otl) == meta["output_token_logprobs_length"] == meta["completion_tokens"] == 16
    for entry in otl:
        check_entry(entry, text=True)
        assert entry[2] == eng.detokenize([entry[1]], skip_special_tokens=False)
    assert "".join(x[2] for x in otl) == obj["text"]
    assert otl[0][2] == " Paris"

    assert len(meta["output_top_logprobs"]) == 16
    for entry, top in zip(otl, meta["output_top_logprobs"], strict=True):
        check_top(top, 5, text=True)
        assert top[0] == entry  # greedy: the chosen token is the most likely one
        assert all(e[2] == eng.detokenize([e[1]], skip_special_tokens=False) for e in top)

    input_top = meta["input_top_logprobs"]
    assert len(input_top) == len(itl) and input_top[0] is None
    for entry, top in zip(itl[1:], input_top[1:], strict=True):
        check_top(top, 5, text=True)
        # A prompt token among the 5 most likely has the same logprob in both families.
        ranked = {e[1]: e[0] for e in top}
        if entry[1] in ranked:
            assert ranked[entry[1]] == pytest.approx(entry[0], abs=1e-6)
        else:
            assert entry[0] <= top[-1][0]


async def test_05_logprob_start_len_batch(model: Model) -> None:
    prompts = ["I have a very good idea on", "Today is a sunndy day and"]
    body = {
        "text": prompts,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        "return_logprob": True,
        "top_logprobs_num": 5,
        "return_text_in_logprobs": True,
        "logprob_start_len": 4,
    }
    items = await generate(model.client, body)
    assert len(items) == 2
    for prompt, item in zip(prompts, items, strict=True):
        meta = item["meta_info"]
        itl = meta["input_token_logprobs"]
        assert meta["prompt_tokens"] == 4 + len(itl)
        assert [x[1] for x in itl] == model.tokenize(prompt)[4:]
        assert itl[0][0] is None  # SGLang: the first scored position has no logprob
        assert meta["input_top_logprobs"][0] is None
        assert all(len(top) == 5 for top in meta["input_top_logprobs"][1:])
        assert prompt.endswith("".join(x[-1] for x in itl))
        assert meta["completion_tokens"] == 4
        assert len(meta["output_token_logprobs"]) == 4
        assert item["text"] == "".join(x[-1] for x in meta["output_token_logprobs"])


async def test_06_long_prompt_top_logprobs_across_prefill_chunks(model: Model) -> None:
    # About 300 tokens: two 256-token prefill chunks.
    text = "I have a very good idea on this. " * 30
    body = {
        "text": text,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 5,
    }
    obj = await generate(model.client, body)
    meta = obj["meta_info"]
    assert 256 < meta["prompt_tokens"] < 512
    assert meta["completion_tokens"] == 4
    otl, top = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(otl) == len(top) == 4
    for i in range(4):
        assert otl[i] == top[i][0]  # the full triple, text null in both
        assert otl[i][2] is None
        check_top(top[i], 5, text=False)
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []

    # The whole prompt scored: once the sentence has repeated a few times the model
    # predicts each token of it with near certainty, in every chunk. Logits rows paired
    # with the wrong targets (at a chunk boundary, say) could not score like that.
    scored = await generate(model.client, {**body, "logprob_start_len": 0, "top_logprobs_num": 0})
    itl = scored["meta_info"]["input_token_logprobs"]
    assert len(itl) == meta["prompt_tokens"]
    assert [x[1] for x in itl] == model.tokenize(text)
    assert scored["output_ids"] == obj["output_ids"]
    later = [x[0] for x in itl[100:]]
    assert sum(later) / len(later) > -0.1
    assert all(x[0] > -1.0 for x in itl[254:258]), itl[254:258]


@pytest.mark.parametrize(
    ("prompt", "max_diff", "mean_diff"),
    [
        # SGLang's bound. Re-scoring up to about 40 tokens runs the same llama.cpp kernels as
        # one-token decodes, and the logprobs come back bit for bit.
        ("I have a very good idea on how to", 0.35, 0.35),
        # Longer batches take llama.cpp's other matmul path: measured, the same positions
        # then differ by 0.05-0.15 on average and up to 0.56 at worst (also for tokens that
        # were prefilled identically). A logits row paired with the wrong position across
        # the chunk boundary would be off by several nats.
        ("Once upon a time, " * 48, 1.0, 0.25),
    ],
    ids=["short", "output-crosses-a-prefill-chunk"],
)
async def test_07_rescoring_reproduces_sampled_logprobs(
    model: Model, prompt: str, max_diff: float, mean_diff: float
) -> None:
    first = await generate(
        model.client,
        {
            "text": prompt,
            "sampling_params": {
                "temperature": 1.0,
                "max_new_tokens": 24,
                "ignore_eos": True,
                "sampling_seed": 1234,
            },
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": 0,
        },
    )
    meta = first["meta_info"]
    prompt_tokens = meta["prompt_tokens"]
    if len(prompt) > 100:
        assert prompt_tokens < 256 < prompt_tokens + 24
    input_ids = [x[1] for x in meta["input_token_logprobs"]] + [
        x[1] for x in meta["output_token_logprobs"]
    ]
    assert input_ids == model.tokenize(prompt) + first["output_ids"]
    score = await generate(
        model.client,
        {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    smeta = score["meta_info"]
    assert smeta["prompt_tokens"] == len(input_ids) and smeta["completion_tokens"] == 0
    assert score["output_ids"] == [] and smeta["output_token_logprobs"] == []
    rescored = smeta["input_token_logprobs"][prompt_tokens:]
    assert [x[1] for x in rescored] == first["output_ids"]
    sampled = [x[0] for x in meta["output_token_logprobs"]]
    # Sampled at temperature 1.0: the logprobs are the model's distribution, so scoring the
    # same tokens as a prompt gives them back (SGLang's bound).
    diffs = [abs(a - b[0]) for a, b in zip(sampled, rescored, strict=True)]
    assert max(diffs) < max_diff and sum(diffs) / len(diffs) < mean_diff, diffs
    # The prompt part is scored the same both times.
    prompt_diff = max(
        abs(a[0] - b[0])
        for a, b in zip(
            meta["input_token_logprobs"][1:],
            smeta["input_token_logprobs"][1:prompt_tokens],
            strict=True,
        )
    )
    assert prompt_diff < 1e-3


async def test_logprobs_are_not_temperature_scaled(model: Model) -> None:
    prompt = "I have a very good idea on how to"
    hot = await generate(
        model.client,
        {
            "text": prompt,
            "sampling_params": {"temperature": 2.0, "max_new_tokens": 12, "sampling_seed": 5},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    meta = hot["meta_info"]
    prompt_tokens = meta["prompt_tokens"]
    score = await generate(
        model.client,
        {
            "input_ids": model.tokenize(prompt) + hot["output_ids"],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.5},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    rescored = score["meta_info"]["input_token_logprobs"]
    # Short enough to re-score on the decode kernels: equal to float precision, whatever the
    # temperature of either request.
    for a, b in zip(meta["input_token_logprobs"][1:], rescored[1:prompt_tokens], strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-4)
    for a, b in zip(meta["output_token_logprobs"], rescored[prompt_tokens:], strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-4)


#: (prompt length, max_new_tokens, logprob_start_len, top_logprobs_num, return_logprob)
MIXED = [
    (40, 4, 0, 0, True),
    (40, 8, 10, 3, True),
    (150, 4, 60, 3, True),
    (150, 8, 0, 5, True),
    (150, 4, 149, 1, True),
    (40, 4, -1, 2, True),
    (40, 4, 10, 3, False),
    (150, 8, 60, 5, False),
    (40, 4, 500, 3, False),  # beyond the prompt, but ignored without return_logprob
]


async def test_08_mixed_logprob_settings_concurrently(model: Model) -> None:
    results: dict[int, dict[str, Any]] = {}

    async def run(i: int) -> None:
        length, new, start, top, wanted = MIXED[i]
        body = {
            "input_ids": list(range(length)),
            "sampling_params": greedy(new),
            "return_logprob": wanted,
            "logprob_start_len": start,
            "top_logprobs_num": top,
        }
        results[i] = await generate(model.client, body)

    async with trio.open_nursery() as nursery:
        for i in range(len(MIXED)):
            nursery.start_soon(run, i)

    outputs: dict[tuple[int, int], list[int]] = {}
    for i, (length, new, start, top, wanted) in enumerate(MIXED):
        obj = results[i]
        meta = obj["meta_info"]
        assert meta["prompt_tokens"] == length and meta["completion_tokens"] == new
        # Logprobs never change what is generated: equal prompts, equal greedy outputs.
        assert outputs.setdefault((length, new), obj["output_ids"]) == obj["output_ids"]
        if not wanted:
            assert not ALL_LOGPROB_KEYS & set(meta), meta
            continue
        itl, otl = meta["input_token_logprobs"], meta["output_token_logprobs"]
        scored_from = length if start == -1 else start
        assert len(itl) + scored_from == length
        assert [x[1] for x in itl] == list(range(scored_from, length))
        assert [x[1] for x in otl] == obj["output_ids"]
        if not top:
            assert not set(TOP_KEYS) & set(meta)
            continue
        input_top, output_top = meta["input_top_logprobs"], meta["output_top_logprobs"]
        assert len(input_top) + scored_from == length and len(output_top) == new
        assert all(len(t) == top for t in output_top)
        if input_top:
            assert input_top[0] is None
            assert all(len(t) == top for t in input_top[1:])
        for entry, ranked in zip(otl, output_top, strict=True):
            # Temperature 0: the sampled token is ranked first (a tie may put it second).
            assert entry in ranked[:2], (entry, ranked)


async def test_token_ids_logprob(model: Model) -> None:
    plain = await generate(model.client, {"text": CAPITAL, "sampling_params": greedy(4)})
    out = plain["output_ids"]
    wanted = [out[0], 0, out[1]]  # request order is kept; 0 is the EOS token
    body = {
        "text": CAPITAL,
        "sampling_params": greedy(4),
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "token_ids_logprob": wanted,
        "return_text_in_logprobs": True,
    }
    obj = await generate(model.client, body)
    meta = obj["meta_info"]
    assert obj["output_ids"] == out
    assert list(meta) == [*META_KEYS, *LOGPROB_KEYS, *TOP_KEYS, *IDS_KEYS, "e2e_latency"]
    otl = meta["output_token_logprobs"]
    output_ids = meta["output_token_ids_logprobs"]
    assert len(output_ids) == 4
    for position in output_ids:
        assert [e[1] for e in position] == wanted
        for entry in position:
            check_entry(entry, text=True)
    assert output_ids[0][0] == otl[0]  # the sampled token, scored the same way
    assert output_ids[1][2] == otl[1]
    assert output_ids[0][0][0] > output_ids[0][1][0]  # " Paris" is far likelier than EOS

    input_ids = meta["input_token_ids_logprobs"]
    itl = meta["input_token_logprobs"]
    assert len(input_ids) == len(itl) == meta["prompt_tokens"] and input_ids[0] is None
    for position, top, entry in zip(
        input_ids[1:], meta["input_top_logprobs"][1:], itl[1:], strict=True
    ):
        assert [e[1] for e in position] == wanted
        ranked = {e[1]: e[0] for e in top}
        for lp, token, _ in position:
            if token in ranked:
                assert lp == pytest.approx(ranked[token], abs=1e-6)
            if token == entry[1]:
                assert lp == pytest.approx(entry[0], abs=1e-6)

    # A batch takes one list per prompt.
    batch = {
        **body,
        "text": [CAPITAL, "1, 2, 3,"],
        "token_ids_logprob": [[out[0]], [3, 4]],
        "top_logprobs_num": 0,
    }
    items = await generate(model.client, batch)
    assert [[e[1] for e in p] for p in items[0]["meta_info"]["output_token_ids_logprobs"]] == [
        [out[0]]
    ] * 4
    assert [[e[1] for e in p] for p in items[1]["meta_info"]["output_token_ids_logprobs"]] == [
        [3, 4]
    ] * 4
    assert items[0]["meta_info"]["output_token_ids_logprobs"][0][0][0] == pytest.approx(
        otl[0][0], abs=1e-6
    )


async def test_eos_and_logit_bias_in_output_logprobs(model: Model) -> None:
    chat = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"
    body = {
        "text": chat,
        "sampling_params": {"temperature": 0, "max_new_tokens": 60},
        "return_logprob": True,
        "return_text_in_logprobs": True,
    }
    obj = await generate(model.client, body)
    meta = obj["meta_info"]
    eos = meta["finish_reason"]["matched"]
    assert (
        meta["finish_reason"]["type"] == "stop" and eos in model.server.eng.model_info.eos_token_ids
    )
    # The EOS is an output position (counted, scored, its text spelled out), never text.
    otl = meta["output_token_logprobs"]
    assert len(otl) == meta["completion_tokens"] == len(obj["output_ids"]) < 60
    assert otl[-1][1] == eos and otl[-1][2] == "<|im_end|>"
    assert "".join(x[2] for x in otl[:-1]) == obj["text"]

    # logit_bias applies before logprobs are read (SGLang's order): a +100 bias makes the
    # token certain, in the sampled and in the reported distribution alike.
    paris = model.tokenize(" Paris")[0]
    biased = {
        "text": CAPITAL,
        "sampling_params": {
            "temperature": 1.0,
            "max_new_tokens": 4,
            "logit_bias": {str(paris): 100},
        },
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    obj = await generate(model.client, biased)
    assert obj["output_ids"] == [paris] * 4
    for entry, top in zip(
        obj["meta_info"]["output_token_logprobs"],
        obj["meta_info"]["output_top_logprobs"],
        strict=True,
    ):
        assert entry[1] == paris and entry[0] > -1e-3
        assert top[0] == entry and top[1][0] < -50


STREAM_BODY = {
    "text": CAPITAL,
    "sampling_params": greedy(8),
    "return_logprob": True,
    "logprob_start_len": 0,
    "top_logprobs_num": 2,
    "token_ids_logprob": [198, 30],
    "return_text_in_logprobs": True,
}
OUTPUT_FAMILIES = ["output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"]
INPUT_FAMILIES = ["input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"]


async def test_incremental_and_cumulative_streams_carry_the_unary_logprobs(model: Model) -> None:
    unary = (await generate(model.client, STREAM_BODY))["meta_info"]

    # Cumulative text and ids, but no logprob position twice (SGLang resends them all in
    # every frame): a frame carries the positions since the previous frame, the input
    # families come in the first frame, and the terminal frame carries everything.
    cumulative = await stream_frames(model.client, STREAM_BODY)
    assert len(cumulative) == 8
    sent = 0
    for i, frame in enumerate(cumulative[:-1]):
        meta = frame["meta_info"]
        n = meta["completion_tokens"]
        assert meta["output_token_logprobs_length"] == n == len(frame["output_ids"])
        for family in OUTPUT_FAMILIES:
            assert meta[family] == unary[family][sent:n], family
        for family in INPUT_FAMILIES:
            assert meta[family] == (unary[family] if i == 0 else [])
        sent = n
    assert {k: cumulative[-1]["meta_info"][k] for k in ALL_LOGPROB_KEYS} == {
        k: unary[k] for k in ALL_LOGPROB_KEYS
    }

    incremental = await stream_frames(model.incremental, STREAM_BODY)
    assert len(incremental) == 8
    for frame in incremental:
        meta = frame["meta_info"]
        # Only this frame's positions, but the length counts all of them so far.
        assert [x[1] for x in meta["output_token_logprobs"]] == frame["output_ids"]
        assert len(meta["output_top_logprobs"]) == len(frame["output_ids"])
        assert len(meta["output_token_ids_logprobs"]) == len(frame["output_ids"])
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
    for i, frame in enumerate(incremental):
        # In the first and the terminal frame only (SGLang repeats them in every frame).
        for family in INPUT_FAMILIES:
            first_or_last = i in (0, len(incremental) - 1)
            assert frame["meta_info"][family] == (unary[family] if first_or_last else [])
    for family in OUTPUT_FAMILIES:
        joined = [x for f in incremental for x in f["meta_info"][family]]
        assert joined == unary[family], family

    # Three tokens a frame: each incremental frame carries its three positions.
    body = {**STREAM_BODY, "sampling_params": greedy(8, stream_interval=3)}
    chunked = await stream_frames(model.incremental, body)
    assert [len(f["output_ids"]) for f in chunked] == [3, 3, 2]
    assert [f["meta_info"]["output_token_logprobs_length"] for f in chunked] == [3, 6, 8]
    for family in OUTPUT_FAMILIES:
        assert [len(f["meta_info"][family]) for f in chunked] == [3, 3, 2]
        assert [x for f in chunked for x in f["meta_info"][family]] == unary[family]


async def test_batch_with_per_prompt_settings_and_n_samples(model: Model) -> None:
    prompts = [CAPITAL, "1, 2, 3,"]
    body = {
        "text": prompts,
        "sampling_params": greedy(5),
        "return_logprob": [True, False],
        "top_logprobs_num": [2, 0],
        "logprob_start_len": [0, -1],
        "return_text_in_logprobs": True,
    }
    first, second = await generate(model.client, body)
    meta = first["meta_info"]
    assert list(meta) == [*META_KEYS, *LOGPROB_KEYS, *TOP_KEYS, "e2e_latency"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert "".join(x[2] for x in meta["output_token_logprobs"]) == first["text"]
    assert not ALL_LOGPROB_KEYS & set(second["meta_info"])

    samples = {
        "text": CAPITAL,
        "sampling_params": {
            "temperature": 0.8,
            "sampling_seed": 7,
            "max_new_tokens": 6,
            "n": 2,
            "ignore_eos": True,
        },
        "return_logprob": True,
        "top_logprobs_num": 3,
        "logprob_start_len": 0,
    }
    items = await generate(model.client, samples)
    assert len(items) == 2
    for item in items:
        m = item["meta_info"]
        assert [x[1] for x in m["output_token_logprobs"]] == item["output_ids"]
        assert len(m["output_top_logprobs"]) == m["completion_tokens"] == 6
        assert [x[1] for x in m["input_token_logprobs"]] == model.tokenize(CAPITAL)
    a, b = (item["meta_info"]["input_token_logprobs"] for item in items)
    assert all(x[0] == pytest.approx(y[0], abs=1e-3) for x, y in zip(a[1:], b[1:], strict=True))

    frames = await stream_frames(model.client, samples)
    finals = {f["index"]: f for f in frames if f["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1]
    for index, final in finals.items():
        m = final["meta_info"]
        assert [x[1] for x in m["output_token_logprobs"]] == final["output_ids"]
        assert final["output_ids"] == items[index]["output_ids"]  # seeded: reproducible
        assert m["output_token_logprobs_length"] == 6


async def test_17_aborted_request_logprobs_match_its_output(model: Model) -> None:
    body = {
        "text": CAPITAL,
        "rid": "long-logprobs",
        "sampling_params": greedy(1000),
        "return_logprob": True,
        "top_logprobs_num": 1,
    }
    eng = model.server.eng
    results: list[dict[str, Any]] = []

    async def run() -> None:
        results.append(await generate(model.client, body))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await wait_until(lambda: eng.stats().generated_tokens >= 5, timeout=30)
        response = await sglang_post(model.client, {"rid": "long-logprobs"}, "/abort_request")
        assert response.status_code == 200
    meta = results[0]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    n = len(results[0]["output_ids"])
    assert 5 <= n < 1000 and meta["completion_tokens"] == n
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == n
    assert meta["output_token_logprobs_length"] == n


def body_with(**extra: Any) -> dict[str, Any]:
    return {"text": CAPITAL, "sampling_params": greedy(2), "return_logprob": True, **extra}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"token_ids_logprob": [-1]}, "out-of-vocabulary"),
        ({"token_ids_logprob": [2e9]}, "out-of-vocabulary"),
        ({"token_ids_logprob": [49152]}, "out-of-vocabulary"),
        ({"token_ids_logprob": [[0]]}, "flat list of integers"),
        ({"token_ids_logprob": ["1"]}, "flat list of integers"),
        (
            {"text": [CAPITAL, "hello"], "token_ids_logprob": [[0], [0, 10**6]]},
            "out-of-vocabulary",
        ),
        ({"logprob_start_len": 6}, "req.logprob_start_len=6 is higher than the number of input"),
        (
            {"text": [CAPITAL, "hello"], "logprob_start_len": [0, 2]},
            "req.logprob_start_len=2 is higher than the number of input tokens",
        ),
    ],
    ids=[
        "minus-one",
        "2e9",
        "vocab-size",
        "nested",
        "string",
        "batch-entry",
        "start-len",
        "batch-start-len",
    ],
)
async def test_21_invalid_logprob_requests_are_400(
    model: Model, extra: dict[str, Any], message: str
) -> None:
    eng = model.server.eng
    generated = eng.stats().generated_tokens
    for stream in (False, True):
        response = await sglang_post(model.client, {**body_with(**extra), "stream": stream})
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
    assert eng.stats().generated_tokens == generated  # nothing ran
    assert eng.stats().running == eng.stats().waiting == 0
    # The next request is served, and [0] is a valid token_ids_logprob.
    ok = await generate(model.client, body_with(token_ids_logprob=[0]))
    assert [[e[1] for e in p] for p in ok["meta_info"]["output_token_ids_logprobs"]] == [[0], [0]]
    # The prompt is exactly 5 tokens: start 5 scores nothing, and is allowed.
    assert len(model.tokenize(CAPITAL)) == 5
    edge = await generate(model.client, body_with(logprob_start_len=5))
    assert edge["meta_info"]["input_token_logprobs"] == []
