"""Constrained decoding on `/generate` with the real model: SGLang's `sampling_params.regex`,
`json_schema` and `ebnf` (llguidance), and `stop_regex`, in every response shape (one
object, a JSON array, cumulative and incremental streams)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import trio
from sglangfixtures import (
    MODES,
    Mode,
    Model,
    Result,
    generate,
    model_fixture,  # noqa: F401  (the `model` fixture)
    run_mode,
    sglang_post,
    stream_frames,
)

pytestmark = pytest.mark.model

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}

PERSON_PROMPTS = [
    "Describe a person as JSON:\n",
    "<|im_start|>user\nInvent a customer record for a small shop.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "Here is the profile of our new admin, as JSON:",
    "User data:",
]

CONFLICT = "Only one of json_schema, regex, ebnf, or structural_tag can be set."


async def run_all_modes(model: Model, bodies: list[dict[str, Any]]) -> dict[Mode, list[Result]]:
    """`bodies` in every mode at once (the engine batches them all)."""
    results: dict[Mode, list[Result]] = {}

    async def run(mode: Mode) -> None:
        results[mode] = await run_mode(model, mode, bodies)

    async with trio.open_nursery() as nursery:
        for mode in MODES:
            nursery.start_soon(run, mode)
    return results


def check_stopped_by_grammar(result: Result) -> None:
    """The grammar (not the length limit) ended the output: SGLang's stop on a token, the
    last one generated."""
    reason = result.finish_reason
    assert reason["type"] == "stop", (reason, result.text)
    assert reason["matched"] == result.output_ids[-1]
    assert result.meta["completion_tokens"] == len(result.output_ids)


async def test_20_json_objects_validate_against_a_nested_schema(model: Model) -> None:
    schema = json.dumps(PERSON_SCHEMA)

    def body(i: int) -> dict[str, Any]:
        sampling = {
            "temperature": 1.0,
            "sampling_seed": 100 + i,
            "max_new_tokens": 256,  # more than the schema's longest object takes
            "json_schema": schema,
        }
        return {"text": PERSON_PROMPTS[i % len(PERSON_PROMPTS)], "sampling_params": sampling}

    results: dict[str, list[Result]] = {}

    async def run(mode: Mode, first: int) -> None:
        results[mode] = await run_mode(model, mode, [body(i) for i in range(first, first + 5)])

    async with trio.open_nursery() as nursery:
        for k, mode in enumerate(MODES):
            nursery.start_soon(run, mode, 5 * k)

    objects = []
    for mode in MODES:
        assert len(results[mode]) == 5
        for result in results[mode]:
            check_stopped_by_grammar(result)
            obj = json.loads(result.text)
            jsonschema.validate(obj, PERSON_SCHEMA)
            objects.append(obj)
    assert len(objects) == 20
    # Sampled with 20 seeds: not one object repeated 20 times.
    assert len({json.dumps(o, sort_keys=True) for o in objects}) > 10


async def test_json_schema_with_n_samples_and_a_stream(model: Model) -> None:
    schema = {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    }
    body = {
        "text": "Is Paris the capital of France? Reply in JSON:",
        "sampling_params": {
            "temperature": 0.8,
            "sampling_seed": 3,
            "n": 3,
            "max_new_tokens": 64,
            "json_schema": json.dumps(schema),
        },
    }
    items = await generate(model.client, body)
    frames = await stream_frames(model.incremental, body)
    assert len(items) == 3
    for i, item in enumerate(items):
        assert item["meta_info"]["finish_reason"]["type"] == "stop", item
        jsonschema.validate(json.loads(item["text"]), schema)
        own = [f for f in frames if f["index"] == i]
        assert "".join(f["text"] for f in own) == item["text"]  # seeded: the same samples


REGEXES = [
    ("Call me at ", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("Contact email: ", r"[a-z]{2,8}@[a-z]{2,8}\.(com|org|net)"),
    ("Date of birth (YYYY-MM-DD): ", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("Is water wet? Answer:", r" (Yes|No), because [a-z ]{1,20}\."),
]


async def test_regex_outputs_fullmatch(model: Model) -> None:
    bodies = [
        {
            "text": prompt,
            "sampling_params": {
                "temperature": 1.0,
                "sampling_seed": seed,
                "max_new_tokens": 48,
                "regex": pattern,
            },
        }
        for prompt, pattern in REGEXES
        for seed in (1, 2)
    ]
    # An unconstrained request decoding in the same steps keeps its own output.
    plain = {"text": "Call me at ", "sampling_params": {"temperature": 0, "max_new_tokens": 32}}
    alone = await generate(model.client, plain)
    beside: list[dict[str, Any]] = []

    async def run_plain() -> None:
        beside.append(await generate(model.client, plain))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_plain)
        by_mode = await run_all_modes(model, bodies)
    assert beside[0]["output_ids"] == alone["output_ids"]
    for mode, results in by_mode.items():
        for body, result in zip(bodies, results, strict=True):
            pattern = body["sampling_params"]["regex"]
            assert re.fullmatch(pattern, result.text), (mode, pattern, result.text)
            check_stopped_by_grammar(result)
            # Seeded: every mode samples the same text.
            assert result.output_ids == by_mode["unary"][bodies.index(body)].output_ids, mode


ANSWER_EBNF = """
root ::= "The answer is " answer "."
answer ::= "yes" | "no" | number
number ::= [1-9] [0-9]?
"""
ANSWER_RE = r"The answer is (yes|no|[1-9][0-9]?)\."


async def test_ebnf_output_matches(model: Model) -> None:
    prompts = ["How many legs does a spider have?", "Is the sky green?", "What is 6 times 7?"]
    bodies = [
        {
            "text": f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
            "sampling_params": {
                "temperature": temperature,
                "sampling_seed": 11,
                "max_new_tokens": 24,
                "ebnf": ANSWER_EBNF,
            },
        }
        for prompt in prompts
        for temperature in (0, 1.0)
    ]
    for mode, results in (await run_all_modes(model, bodies)).items():
        for result in results:
            assert re.fullmatch(ANSWER_RE, result.text), (mode, result.text)
            check_stopped_by_grammar(result)


async def test_a_finished_grammar_stops_generation(model: Model) -> None:
    # A grammar with one possible end: generation stops there, with finish_reason "stop",
    # long before max_new_tokens, and the last token's text is in the output.
    bodies = [
        {
            "text": prompt,
            "sampling_params": {"temperature": t, "max_new_tokens": 16, "regex": "(True|False)"},
        }
        for prompt in ("Is Paris in France? Answer True or False:", "2 + 2 = 5. True or False?")
        for t in (0, 1.0)
    ]
    for mode, results in (await run_all_modes(model, bodies)).items():
        for result in results:
            assert result.text in ("True", "False"), (mode, result.text)
            check_stopped_by_grammar(result)
            assert len(result.output_ids) <= 3


async def test_an_empty_grammar_is_unset(model: Model) -> None:
    body = {"text": "Answer:", "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    plain = await generate(model.client, body)
    sampling = {**body["sampling_params"], "regex": "", "json_schema": "", "ebnf": None}
    unset = await generate(model.client, {**body, "sampling_params": sampling})
    assert unset["output_ids"] == plain["output_ids"]
    # "" does not count towards "only one grammar" either.
    sampling = {**body["sampling_params"], "regex": "(yes|no)", "json_schema": ""}
    constrained = await generate(model.client, {**body, "sampling_params": sampling})
    assert constrained["text"] in ("yes", "no")


async def expect_400(model: Model, body: dict[str, Any], *needles: str) -> None:
    """A 400 naming the problem, for the unary and the streaming form alike, with nothing
    run; then the server still serves."""
    eng = model.server.eng
    generated = eng.stats().generated_tokens
    for stream in (False, True):
        response = await sglang_post(model.client, {**body, "stream": stream})
        assert response.status_code == 400, response.text
        assert response.headers["content-type"] == "application/json"
        message = response.json()["error"]["message"]
        for needle in needles:
            assert needle in message, message
    assert eng.stats().generated_tokens == generated
    assert eng.stats().running == eng.stats().waiting == 0


GRAMMARS = {
    "regex": "(yes|no)",
    "json_schema": json.dumps({"type": "object"}),
    "ebnf": 'root ::= "yes" | "no"',
}


@pytest.mark.parametrize(
    "pair",
    [("regex", "json_schema"), ("regex", "ebnf"), ("json_schema", "ebnf")],
    ids=lambda p: "+".join(p),
)
async def test_at_most_one_grammar(model: Model, pair: tuple[str, str]) -> None:
    sampling = {"max_new_tokens": 4, **{kind: GRAMMARS[kind] for kind in pair}}
    await expect_400(model, {"text": "Answer:", "sampling_params": sampling}, CONFLICT)
    # In a batch, one item with two grammars refuses the whole request.
    batch = {
        "text": ["Answer:", "Reply:"],
        "sampling_params": [{"max_new_tokens": 4, "regex": "(yes|no)"}, sampling],
    }
    await expect_400(model, batch, CONFLICT)
    # Either grammar alone is fine.
    for kind in pair:
        alone = {"max_new_tokens": 4, kind: GRAMMARS[kind]}
        ok = await generate(model.client, {"text": "Answer:", "sampling_params": alone})
        assert ok["meta_info"]["completion_tokens"] >= 1


#: (sampling params, what the 400's message must name)
INVALID = [
    ({"regex": "(yes|no"}, ["Invalid regex", "unclosed group"]),
    ({"regex": "(?=a)a"}, ["Invalid regex", "look-around"]),
    ({"json_schema": "{not json"}, ["Invalid json_schema", "not valid JSON"]),
    ({"json_schema": json.dumps({"type": "bogus"})}, ["Invalid json_schema", "bogus"]),
    (
        {"json_schema": json.dumps({"$ref": "#/definitions/missing"})},
        ["Invalid json_schema", "/definitions/missing"],
    ),
    ({"ebnf": "root ::= ("}, ["Invalid ebnf"]),
    ({"ebnf": "root ::= missing"}, ["Invalid ebnf", "missing"]),
    ({"stop_regex": ["fine", "(unclosed"]}, ["invalid stop_regex '(unclosed'"]),
]


async def test_invalid_grammar_is_a_400_before_anything_runs(model: Model) -> None:
    for sampling, needles in INVALID:
        body = {"text": "Answer:", "sampling_params": {"max_new_tokens": 4, **sampling}}
        await expect_400(model, body, *needles)
        # A batch whose other item is valid: nothing of it runs either.
        batch = {
            "text": ["Answer:", "Reply:"],
            "sampling_params": [
                {"max_new_tokens": 200, "regex": "[a-z]+"},
                {"max_new_tokens": 4, **sampling},
            ],
        }
        await expect_400(model, batch, *needles)
        ok = await generate(
            model.client,
            {"text": "Answer:", "sampling_params": {"max_new_tokens": 8, "regex": "(yes|no)"}},
        )
        assert ok["text"] in ("yes", "no")


#: Contract item 9, SGLang's `test_logprob_grammar` body.
GRAMMAR_LOGPROBS = {
    "text": "Question: Is Paris the Capital of France? Answer:",
    "sampling_params": {"temperature": 1.0, "max_new_tokens": 1, "regex": "( Yes| No)"},
    "return_logprob": True,
    "top_logprobs_num": 5,
    "return_text_in_logprobs": True,
}


async def test_09_regex_with_logprobs(model: Model) -> None:
    by_mode = await run_all_modes(model, [GRAMMAR_LOGPROBS] * 3)
    for result in (r for results in by_mode.values() for r in results):
        top = result.meta["output_top_logprobs"][0]
        texts = [x[2] for x in top]
        assert " Yes" in texts and " No" in texts, top
        # The top logprobs are read after the grammar's mask: every token with a logprob is
        # one the regex allows here, and together they hold all the probability.
        allowed = [x for x in top if x[0] is not None]
        assert all(" Yes".startswith(x[2]) or " No".startswith(x[2]) for x in allowed), top
        assert sum(2.718281828459045 ** x[0] for x in allowed) == pytest.approx(1, abs=0.01)
        assert result.text and (" Yes".startswith(result.text) or " No".startswith(result.text))
        sampled = result.meta["output_token_logprobs"][0]
        assert sampled[1] == result.output_ids[0] and sampled in top


# -- stop_regex ----------------------------------------------------------------------------

STOP_PROMPT = "USER:What is the capital of France?\nASSISTANT:"


async def greedy_tokens(model: Model, max_new_tokens: int) -> list[str]:
    """The greedy continuation of STOP_PROMPT, one text per token."""
    body = {
        "text": STOP_PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        "return_logprob": True,
        "return_text_in_logprobs": True,
    }
    obj = await generate(model.client, body)
    return [x[2] for x in obj["meta_info"]["output_token_logprobs"]]


def first_stop(pieces: list[str], patterns: list[str]) -> tuple[int, str, re.Match[str]]:
    """SGLang's rule: after each token, search each pattern (in order) in the output so far.
    Returns (tokens generated, pattern, match)."""
    for i in range(len(pieces)):
        text = "".join(pieces[: i + 1])
        for pattern in patterns:
            if m := re.search(pattern, text):
                return i + 1, pattern, m
    raise AssertionError(f"no pattern of {patterns} matches {''.join(pieces)!r}")


#: stop_regex lists, each ending the greedy continuation of STOP_PROMPT somewhere else.
STOP_REGEXES = [[r"France\s"], [r"[,;:!?]"], ["zzz", r"a \w+ \w+"], [r"(?i)CLASSIC"]]


async def test_stop_regex(model: Model) -> None:
    pieces = await greedy_tokens(model, 24)
    bodies = [
        {
            "text": STOP_PROMPT,
            "sampling_params": {"temperature": 0, "max_new_tokens": 24, "stop_regex": patterns},
        }
        for patterns in STOP_REGEXES
    ]
    by_mode = await run_all_modes(model, bodies)
    kept = await run_mode(
        model,
        "unary",
        [{**b, "sampling_params": {**b["sampling_params"], "no_stop_trim": True}} for b in bodies],
    )
    for i, patterns in enumerate(STOP_REGEXES):
        tokens, pattern, match = first_stop(pieces, patterns)
        full = "".join(pieces[:tokens])
        for mode, results in by_mode.items():
            result = results[i]
            assert result.finish_reason == {"type": "stop", "matched": pattern}, mode
            assert result.meta["completion_tokens"] == tokens
            # The match and anything after it are cut from the text (Tributary trims what
            # the pattern matched; SGLang only finds the pattern's own spelling to trim).
            assert result.text == full[: match.start()], (mode, patterns, result.text)
            shown = ""
            for frame in result.frames:
                shown = shown + frame["text"] if mode == "incremental" else frame["text"]
                # A stream never shows text that is later taken back.
                assert result.text.startswith(shown), (mode, patterns, shown)
        assert kept[i].text == full[: match.end()]
        assert kept[i].finish_reason == {"type": "stop", "matched": pattern}


async def test_stop_regex_string_form_and_empty_list(model: Model) -> None:
    pieces = await greedy_tokens(model, 12)
    body = {"text": STOP_PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 12}}
    as_string = await generate(
        model.client,
        {**body, "sampling_params": {**body["sampling_params"], "stop_regex": "Paris"}},
    )
    assert as_string["meta_info"]["finish_reason"] == {"type": "stop", "matched": "Paris"}
    assert "Paris" not in as_string["text"]
    # `^` is the start of the generated text: the prompt is never searched.
    anchored = await generate(
        model.client,
        {**body, "sampling_params": {**body["sampling_params"], "stop_regex": ["^USER", "^Par"]}},
    )
    assert anchored["meta_info"]["finish_reason"] == {"type": "stop", "matched": "^Par"}
    assert anchored["text"] == "" and pieces[0].startswith("Par")
    # A stop string and a pattern matching at the same place: the stop string wins.
    both = await generate(
        model.client,
        {
            **body,
            "sampling_params": {
                **body["sampling_params"],
                "stop": ["Paris"],
                "stop_regex": "P\\w+",
            },
        },
    )
    assert both["meta_info"]["finish_reason"] == {"type": "stop", "matched": "Paris"}
    empty = await generate(
        model.client, {**body, "sampling_params": {**body["sampling_params"], "stop_regex": []}}
    )
    assert empty["text"] == "".join(pieces)
    assert empty["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
