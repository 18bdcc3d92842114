"""SGLang's frontend language (`sglang.lang`, RuntimeEndpoint, sglang 0.5.23) against the real
model: the exact bodies and headers its `gen`, streaming `gen`, `select`, `gen_int` /
`gen(dtype=...)`, `get_model_info` and `flush_cache` calls send, and what the client reads
back (docs: /tmp/research/sglang_compat.md section 1)."""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import pytest
import trio
from sglangfixtures import (
    SGLANG_HEADERS,
    Model,
    client_stream_text,
    generate,
    model_fixture,  # noqa: F401  (the `model` fixture)
    sglang_post,
    stream_frames,
)

pytestmark = pytest.mark.model

# `sglang/lang/ir.py`: the regexes `gen(dtype=...)` and `gen_int`/`gen_string` send.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

#: The program text SGLang's "default" chat template builds (the template the client picks
#: for a model path it does not recognise): `USER:` + content + newline, then `ASSISTANT:`.
CAPITAL = "USER:What is the capital of France?\nASSISTANT:"


def gen_body(text: str, **sampling: Any) -> dict[str, Any]:
    """`RuntimeEndpoint.generate`'s body for `sgl.gen(...)` under `.run()`'s defaults:
    every sampling key, with `[]` and null for the unset ones, in the client's order."""
    params = {
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "max_new_tokens": 128,
        "min_new_tokens": 0,
        "n": 1,
        "stop": [],
        "stop_token_ids": [],
        "stop_regex": [],
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "regex": None,
        "json_schema": None,
    }
    assert set(sampling) <= set(params), set(sampling) - set(params)
    params.update(sampling)
    return {"text": text, "sampling_params": params}


def check_client_reads(obj: dict[str, Any], max_new_tokens: int) -> None:
    """`generate` appends `obj["text"]` to the program and keeps `obj["meta_info"]`."""
    assert isinstance(obj["text"], str)
    meta = obj["meta_info"]
    assert meta["completion_tokens"] == len(obj["output_ids"]) <= max_new_tokens
    assert meta["finish_reason"]["type"] in ("stop", "length")


async def test_model_info_server_info_and_flush_cache(model: Model) -> None:
    # RuntimeEndpoint(base_url) GETs /get_model_info (with the JSON header even without a
    # body) and picks a chat template from `model_path`.
    info = await model.client.get("/get_model_info", headers=SGLANG_HEADERS)
    assert info.status_code == 200
    model_path = info.json()["model_path"]
    assert model_path == model.server.eng.model_info.path and model_path.endswith(".gguf")
    # flush_cache(): a POST with no body; any status but 200 raises in the client.
    assert (await sglang_post(model.client, None, "/flush_cache")).status_code == 200
    server_info = await model.client.get("/server_info", headers=SGLANG_HEADERS)
    assert server_info.status_code == 200
    assert isinstance(server_info.json()["max_total_num_tokens"], int)
    assert isinstance(server_info.json()["version"], str)


async def test_gen_body_empty_lists_and_nulls_mean_unset(model: Model) -> None:
    frontend = await generate(model.client, gen_body(CAPITAL, max_new_tokens=16, temperature=0))
    plain = {"text": CAPITAL, "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    reference = await generate(model.client, plain)
    assert frontend["text"] == reference["text"] and "Paris" in frontend["text"]
    assert frontend["output_ids"] == reference["output_ids"]
    assert frontend["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    check_client_reads(frontend, 16)


async def test_gen_with_run_defaults_samples(model: Model) -> None:
    # temperature 1.0, top_k -1 ("no cut"), min_p 0.0: three draws, each a valid answer.
    bodies = [gen_body(CAPITAL, max_new_tokens=16) for _ in range(3)]
    async with trio.open_nursery() as nursery:
        results: list[dict[str, Any]] = []

        async def one(body: dict[str, Any]) -> None:
            results.append(await generate(model.client, body))

        for body in bodies:
            nursery.start_soon(one, body)
    for obj in results:
        check_client_reads(obj, 16)
    assert len({tuple(obj["output_ids"]) for obj in results}) > 1  # really sampled


async def test_gen_logprob_options_are_top_level_keys(model: Model) -> None:
    # gen(return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True): the client
    # adds each option that is not None at the top level of the body.
    body = {
        **gen_body(CAPITAL, max_new_tokens=6, temperature=0),
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    obj = await generate(model.client, body)
    meta = obj["meta_info"]
    assert [x[1] for x in meta["output_token_logprobs"]] == obj["output_ids"]
    assert "".join(x[2] for x in meta["output_token_logprobs"]) == obj["text"]
    assert [len(top) for top in meta["output_top_logprobs"]] == [2] * len(obj["output_ids"])
    assert meta["input_token_logprobs"] == []  # logprob_start_len unset: output only


@pytest.mark.parametrize(
    "sampling",
    [{"stop": ["\n\n"]}, {"stop_regex": [r"France\s"]}, {}],
    ids=["stop", "stop_regex", "length"],
)
async def test_streaming_gen_text_only_grows(model: Model, sampling: dict[str, Any]) -> None:
    body = gen_body(CAPITAL, max_new_tokens=20, temperature=0, **sampling)
    unary = await generate(model.client, body)
    frames = await stream_frames(model.client, body)
    assert len(frames) >= 2
    for previous, frame in itertools.pairwise(frames):
        assert frame["text"].startswith(previous["text"]), (previous["text"], frame["text"])
    # What `generate_stream` yields, piece by piece, adds up to the unary answer.
    assert client_stream_text(frames) == unary["text"] == frames[-1]["text"]
    assert frames[-1]["meta_info"]["finish_reason"] == unary["meta_info"]["finish_reason"]
    if sampling:
        assert unary["meta_info"]["finish_reason"]["type"] == "stop"
        assert unary["text"] == ("Paris, " if "stop_regex" in sampling else "Paris, France")


def normalized_prompt_logprob(input_logprobs: list[list[Any]]) -> float:
    """`sglang.lang.backend.runtime_endpoint.compute_normalized_prompt_logprobs`."""
    values = [x[0] for x in input_logprobs if x[0]]
    return sum(values) / len(values)


async def select(model: Model, text: str, choices: list[str]) -> tuple[str, list[float]]:
    """`RuntimeEndpoint.select` with the default `token_length_normalized` method: the
    decision and each choice's normalized prompt logprob. Checks the shape of every field
    the client reads on the way."""
    prefix = await generate(model.client, {"text": text, "sampling_params": {"max_new_tokens": 0}})
    assert prefix["text"] == "" and prefix["output_ids"] == []
    prompt_len = prefix["meta_info"]["prompt_tokens"]
    assert prompt_len == len(model.tokenize(text))
    start = max(prompt_len - 2, 0)  # "For token healing"
    body = {
        "text": [text + c for c in choices],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": start,
    }
    items = await generate(model.client, body)
    assert isinstance(items, list) and len(items) == len(choices)
    input_token_logprobs = [r["meta_info"]["input_token_logprobs"] for r in items]
    output_token_logprobs = [r["meta_info"]["output_token_logprobs"] for r in items]
    for item, choice, itl, otl in zip(
        items, choices, input_token_logprobs, output_token_logprobs, strict=True
    ):
        meta = item["meta_info"]
        assert otl == [] and item["output_ids"] == [] and meta["completion_tokens"] == 0
        assert len(itl) == meta["prompt_tokens"] - start
        assert [x[1] for x in itl] == model.tokenize(text + choice)[start:]
        assert all(len(x) == 3 and isinstance(x[1], int) and isinstance(x[2], str) for x in itl)
        assert itl[0][0] is None
        assert all(isinstance(x[0], float) and x[0] <= 0 for x in itl[1:])
        assert "".join(x[2] for x in itl).endswith(choice)
    normalized = [normalized_prompt_logprob(itl) for itl in input_token_logprobs]
    # The client's token-healing fix-up: with SGLang's `[null, ...]` first entry it would
    # raise (a latent client bug); a server must leave that entry as it is, so a prompt that
    # does not end with the first scored token's text must not reach it.
    for itl in input_token_logprobs:
        assert not text.endswith(itl[0][-1])
    decision = choices[max(range(len(choices)), key=lambda i: normalized[i])]
    return decision, normalized


@pytest.mark.parametrize(
    ("text", "choices", "expected"),
    [
        (CAPITAL + "The capital of France is", [" London", " Paris", " Berlin"], " Paris"),
        ("USER:Continue: 1, 2, 3, 4,\nASSISTANT:1, 2, 3, 4,", [" 9", " 5", " 0"], " 5"),
        (
            "USER:What color is the sky on a clear day?\nASSISTANT:The sky is",
            [" green", " blue", " purple"],
            " blue",
        ),
    ],
    ids=["capital", "counting", "sky"],
)
async def test_select_picks_the_sensible_choice(
    model: Model, text: str, choices: list[str], expected: str
) -> None:
    decision, normalized = await select(model, text, choices)
    assert decision == expected, dict(zip(choices, normalized, strict=True))
    assert all(math.isfinite(v) and v < 0 for v in normalized)


async def test_gen_regex_fullmatches(model: Model) -> None:
    # sgl.gen("phone", regex=...): the client checks the pattern with re.compile, then sends
    # it as sampling_params.regex; temperature 1.0 and max_new_tokens 128 are run()'s.
    pattern = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    re.compile(pattern)
    text = "USER:What is your phone number?\nASSISTANT:My phone number is "
    results: list[dict[str, Any]] = []

    async def one() -> None:
        results.append(await generate(model.client, gen_body(text, regex=pattern)))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
    for obj in results:
        assert re.fullmatch(pattern, obj["text"]), obj["text"]
        assert obj["meta_info"]["finish_reason"]["type"] == "stop"


GEN_INT_PROMPTS = [
    "USER:What is 2 + 3?\nASSISTANT:2 + 3 = ",
    "USER:In which year did World War II end?\nASSISTANT:It ended in ",
    "USER:How many days are in a week?\nASSISTANT:",
]


async def test_gen_int(model: Model) -> None:
    # sgl.gen_int(...): regex REGEX_INT and stop [" ", "\n"]; programs of a run_batch each
    # send their own request, concurrently.
    results: dict[str, dict[str, Any]] = {}

    async def one(text: str) -> None:
        body = gen_body(text, stop=[" ", "\n"], regex=REGEX_INT)
        results[text] = await generate(model.client, body)

    async with trio.open_nursery() as nursery:
        for text in GEN_INT_PROMPTS:
            nursery.start_soon(one, text)
    for text in GEN_INT_PROMPTS:
        obj = results[text]
        answer = obj["text"]
        assert re.fullmatch(r"[-+]?[0-9]+", answer), (text, answer)
        assert re.fullmatch(REGEX_INT, answer)
        int(answer)  # what a program does with the variable
        check_client_reads(obj, 128)


@pytest.mark.parametrize(
    ("text", "answer"),
    [(GEN_INT_PROMPTS[0], "5"), (GEN_INT_PROMPTS[1], "1945")],
    ids=["sum", "year"],
)
async def test_gen_int_greedy_answer(model: Model, text: str, answer: str) -> None:
    body = gen_body(text, temperature=0, stop=[" ", "\n"], regex=REGEX_INT)
    obj = await generate(model.client, body)
    # The grammar allows the trailing newline; the stop string ends the answer there.
    assert obj["text"] == answer
    assert obj["meta_info"]["finish_reason"] == {"type": "stop", "matched": "\n"}


async def test_gen_float(model: Model) -> None:
    text = "USER:What is the value of pi?\nASSISTANT:Pi is approximately "
    body = gen_body(text, temperature=0, max_new_tokens=16, stop=[" ", "\n"], regex=REGEX_FLOAT)
    obj = await generate(model.client, body)
    assert re.fullmatch(r"[-+]?[0-9]*\.?[0-9]+", obj["text"]), obj["text"]
    assert obj["text"].startswith("3.1")
    float(obj["text"])


async def test_gen_string(model: Model) -> None:
    # gen(dtype=str) / gen_string: a quoted string of word characters and spaces.
    text = "USER:What is the capital of France? Answer with a quoted name.\nASSISTANT:"
    body = gen_body(text, temperature=0, max_new_tokens=32, regex=REGEX_STR)
    obj = await generate(model.client, body)
    assert re.fullmatch(REGEX_STR, obj["text"]), obj["text"]
    assert obj["text"] == '"Paris"'
    assert obj["meta_info"]["finish_reason"]["type"] == "stop"


async def test_gen_bool(model: Model) -> None:
    texts = [
        "USER:Is Paris in France? Answer True or False.\nASSISTANT:",
        "USER:Is the sun cold? Answer True or False.\nASSISTANT:",
    ]
    for temperature in (0, 1.0):
        for text in texts:
            obj = await generate(
                model.client, gen_body(text, temperature=temperature, regex=REGEX_BOOL)
            )
            assert obj["text"] in ("True", "False"), obj["text"]
            assert obj["meta_info"]["finish_reason"]["type"] == "stop"
            # The grammar, not max_new_tokens, ended it: one or two tokens, not 128.
            assert obj["meta_info"]["completion_tokens"] <= 3


async def test_runtime_generate_bodies_with_explicit_nulls(model: Model) -> None:
    # `sglang.Runtime.generate` / `async_generate` send every optional key, null when unset.
    body = {
        "text": [CAPITAL, "USER:Name a colour.\nASSISTANT:"],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "return_logprob": False,
        "logprob_start_len": None,
        "top_logprobs_num": None,
        "lora_path": None,
        "session_id": None,
    }
    items = await generate(model.client, body)
    assert [item["meta_info"]["completion_tokens"] for item in items] == [8, 8]
    assert "output_token_logprobs" not in items[0]["meta_info"]
    # async_generate: `sampling_params: null` means every default: temperature 1.0 and
    # max_new_tokens 128 (a chat prompt the model answers briefly usually ends with its EOS
    # before that).
    chat = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"
    frames = await stream_frames(
        model.client, {"text": chat, "sampling_params": None, "session_id": None}
    )
    assert client_stream_text(frames) == frames[-1]["text"] != ""
    meta = frames[-1]["meta_info"]
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"] == {"type": "length", "length": 128}
    else:
        assert meta["finish_reason"]["matched"] in model.server.eng.model_info.eos_token_ids
        assert meta["completion_tokens"] < 128
