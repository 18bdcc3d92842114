"""`response_format` and SGLang's constraint extras on `/v1`: what they become for the engine,
output that follows the schema on the real model, and the 400s for bad or conflicting ones."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from apphelpers import Server
from openaihelpers import chat_body, model_name

from tributary.app.http.errors import InvalidRequest
from tributary.app.openai import parse_chat, parse_completion
from tributary.engine import InvalidSamplingParams

pytest_plugins = ["openaifixtures"]  # model_server, http, aclient

VOCAB = 1000
USER = [{"role": "user", "content": "hi"}]
CONFLICT = "Only one of json_schema, regex, ebnf, or structural_tag can be set."

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "species": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "toys": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
        "owner": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "verified": {"type": "boolean"},
            },
            "required": ["city", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "species", "age", "toys", "owner"],
    "additionalProperties": False,
}


def json_schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}


# --- what the engine is asked for, without a model ------------------------------------------


def test_response_format_becomes_json_schema() -> None:
    for parse, base in ((parse_chat, {"messages": USER}), (parse_completion, {"prompt": "hi"})):

        def schema(fmt: Any, parse: Any = parse, base: Any = base) -> str | None:
            return parse({**base, "response_format": fmt}, vocab_size=VOCAB).sampling.json_schema

        assert schema(None) is None and schema({"type": "text"}) is None
        assert schema({"type": "json_object"}) == '{"type": "object"}'  # SGLang's string
        assert schema(json_schema_format(PET)) == json.dumps(PET)
        # SGLang's field name for the schema is accepted too; `strict` is not looked at.
        alias = {
            "type": "json_schema",
            "json_schema": {"name": "p", "schema_": PET, "strict": False},
        }
        assert schema(alias) == json.dumps(PET)


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        ({"type": "json_schema", "json_schema": {"name": "p"}}, "json_schema.schema is required"),
        ({"type": "json_schema"}, "response_format.json_schema is required"),
        (json_schema_format([1]), "must be a JSON Schema object"),
        ({"type": "xml"}, "response_format.type must be one of 'text', 'json_object'"),
        ({}, "response_format.type must be one of"),
        ("json", "response_format must be an object"),
        ({"type": "structural_tag"}, "'structural_tag' is not supported by this server yet"),
    ],
)
def test_bad_response_formats(fmt: Any, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        parse_chat({"messages": USER, "response_format": fmt}, vocab_size=VOCAB)
    assert info.value.param == "response_format"


def test_one_constraint_at_a_time() -> None:
    json_object = {"type": "json_object"}
    for extra in ({"regex": "a+"}, {"ebnf": 'root ::= "a"'}):
        with pytest.raises(InvalidSamplingParams) as info:
            parse_chat(
                {"messages": USER, "response_format": json_object, **extra}, vocab_size=VOCAB
            )
        assert str(info.value) == CONFLICT
    with pytest.raises(InvalidRequest) as conflict:
        parse_completion(
            {"prompt": "hi", "json_schema": "{}", "response_format": json_object},
            vocab_size=VOCAB,
        )
    assert conflict.value.message == CONFLICT
    with pytest.raises(InvalidSamplingParams, match=CONFLICT):
        parse_completion({"prompt": "hi", "json_schema": "{}", "regex": "a"}, vocab_size=VOCAB)


def test_sglang_extras_pass_through() -> None:
    req = parse_chat(
        {
            "messages": USER,
            "stop_regex": r"\d+",
            "custom_params": {"k": 1},
            "custom_logit_processor": '{"callable": "00"}',
            "regex": "[ab]+",
        },
        vocab_size=VOCAB,
    )
    assert req.sampling.stop_regex == (r"\d+",)
    assert dict(req.sampling.custom_params or {}) == {"k": 1}
    assert req.sampling.regex == "[ab]+"
    assert req.custom_logit_processor == '{"callable": "00"}'
    with pytest.raises(InvalidRequest, match="custom_logit_processor must be a string"):
        parse_completion({"prompt": "hi", "custom_logit_processor": {}}, vocab_size=VOCAB)
    with pytest.raises(InvalidSamplingParams, match="structural_tag is not supported"):
        parse_completion({"prompt": "hi", "structural_tag": "{}"}, vocab_size=VOCAB)


# --- the real model -------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize(
    "question",
    ["Describe my pet as JSON.", "Tell me about a dog named Rex.", "Make up a bird."],
)
async def test_chat_output_follows_the_schema(
    aclient: openai.AsyncOpenAI, model_server: Server, question: str
) -> None:
    reply = await aclient.chat.completions.create(
        model=model_name(model_server),
        messages=[{"role": "user", "content": question}],
        max_tokens=150,
        temperature=0,
        response_format=json_schema_format(PET),  # type: ignore[arg-type]
    )
    [choice] = reply.choices
    assert choice.finish_reason == "stop", choice.message.content  # the grammar ended it
    jsonschema.validate(json.loads(choice.message.content or ""), PET)


@pytest.mark.model
async def test_completion_output_follows_the_schema(
    aclient: openai.AsyncOpenAI, model_server: Server
) -> None:
    name = model_name(model_server)
    result = await aclient.completions.create(
        model=name,
        prompt="A pet record in JSON:",
        max_tokens=150,
        temperature=0,
        extra_body={"response_format": json_schema_format(PET)},
    )
    jsonschema.validate(json.loads(result.choices[0].text), PET)
    stream = await aclient.completions.create(
        model=name,
        prompt="A pet record in JSON:",
        max_tokens=150,
        temperature=0,
        stream=True,
        extra_body={"response_format": json_schema_format(PET)},
    )
    text = "".join([chunk.choices[0].text async for chunk in stream])
    jsonschema.validate(json.loads(text), PET)


@pytest.mark.model
@pytest.mark.parametrize(
    "question", ["Return an empty JSON object.", "What is 2+2? Answer in JSON."]
)
async def test_json_object(
    aclient: openai.AsyncOpenAI, model_server: Server, question: str
) -> None:
    reply = await aclient.chat.completions.create(
        model=model_name(model_server),
        messages=[{"role": "user", "content": question}],
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


async def assert_400(http: httpx.AsyncClient, body: dict[str, Any], contains: str) -> None:
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert contains in response.json()["error"]["message"], response.text


@pytest.mark.model
async def test_bad_constraints_are_400s_and_the_server_keeps_serving(
    http: httpx.AsyncClient, model_server: Server
) -> None:
    def body(**extra: Any) -> dict[str, Any]:
        return chat_body(model_server, **extra)

    # The engine compiles the schema at submit: the message names what is wrong with it.
    await assert_400(
        http, body(response_format=json_schema_format({"type": "objec"})), "Invalid json_schema"
    )
    await assert_400(
        http,
        body(response_format=json_schema_format({"type": "object", "required": 5})),
        "Invalid json_schema",
    )
    await assert_400(
        http,
        body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        "response_format.json_schema.schema is required",
    )
    await assert_400(http, body(response_format={"type": "json_object"}, regex="a+"), CONFLICT)
    await assert_400(
        http, body(custom_logit_processor='{"callable": "00"}'), "custom logit processor"
    )
    assert model_server.eng.stats().running == 0
    ok = await http.post("/v1/chat/completions", json=body())
    assert ok.status_code == 200 and "4" in ok.json()["choices"][0]["message"]["content"]


@pytest.mark.model
async def test_stop_regex_passes_through(http: httpx.AsyncClient, model_server: Server) -> None:
    response = await http.post(
        "/v1/completions",
        json={"prompt": "1, 2, 3,", "max_tokens": 8, "temperature": 0, "stop_regex": "[0-9]"},
    )
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "stop"
    assert not any(c.isdigit() for c in choice["text"]), choice
