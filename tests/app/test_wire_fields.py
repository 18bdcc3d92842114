"""Field drift: every request field the server accepts is documented, in `/openapi.json` and in
docs/api.md's field tables, and every documented field is accepted (or documented as refused).

The declarations (app/sglang/protocol.py, app/openai/models.py, engine.SamplingParamsBody) are
the source; each check names the fields that differ, one by one. A declared field whose
description starts "Not supported" is one the server refuses when set: the parsers must refuse
it, and the docs must say so; every other declared field must parse with a value of its
documented type.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tributary.app.openai.models import ChatBody, CompletionBody
from tributary.app.openai.protocol import parse_chat, parse_completion
from tributary.app.openapi import openapi_document
from tributary.app.sglang.normalize import normalize_generate
from tributary.app.sglang.protocol import AbortBody, DetokenizeBody, GenerateBody, TokenizeBody
from tributary.engine import BadRequest, SamplingParams
from tributary.engine.sampling import SamplingParamsBody

API_DOC = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
DOC = openapi_document(version="test")
SCHEMAS = DOC["components"]["schemas"]
VOCAB = 1000
REFUSED = "Not supported"

#: (operation, the declaration of its body, docs/api.md's section holding its field tables)
BODIES: list[tuple[str, str, type[msgspec.Struct], str]] = [
    ("/generate", "post", GenerateBody, "## `POST /generate`"),
    ("/tokenize", "post", TokenizeBody, "## `POST /tokenize`"),
    ("/detokenize", "post", DetokenizeBody, "## `POST /detokenize`"),
    ("/abort_request", "post", AbortBody, "## `POST /abort_request`"),
    ("/v1/completions", "post", CompletionBody, "### Request fields"),
    ("/v1/chat/completions", "post", ChatBody, "### Request fields"),
]


def declared(model: type[msgspec.Struct]) -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(model)}


def refused(model: type[msgspec.Struct]) -> set[str]:
    props = msgspec.json.schema(model)["$defs"][model.__name__]["properties"]
    return {name for name, prop in props.items() if prop.get("description", "").startswith(REFUSED)}


def differences(accepted: set[str], documented: set[str], where: str) -> list[str]:
    return [f"{name}: accepted but not in {where}" for name in sorted(accepted - documented)] + [
        f"{name}: in {where} but not accepted" for name in sorted(documented - accepted)
    ]


def doc_tables(heading: str, header: str) -> dict[str, str]:
    """{field: its row} for the tables under `heading` (to the next heading of its level)
    whose header row starts with `header`; every backticked name of a row's first cell."""
    level = heading.split(" ")[0]
    start = API_DOC.index(f"\n{heading}")
    end = API_DOC.find(f"\n{level} ", start + 1)
    section = API_DOC[start : end if end > 0 else None]
    rows: dict[str, str] = {}
    for table in re.findall(r"\n(\|.*\|\n\|[-|]+\|\n(?:\|.*\|\n)+)", section):
        lines = table.strip().splitlines()
        if not lines[0].startswith(header):
            continue
        for line in lines[2:]:
            first = line.split("|")[1]
            for name in re.findall(r"`([a-z_]+)(?:\.[a-z_]+)?`", first):
                rows[name] = line
    return rows


@pytest.mark.parametrize(("path", "method", "model", "heading"), BODIES, ids=lambda x: str(x))
def test_every_body_field_is_in_openapi(
    path: str, method: str, model: type[msgspec.Struct], heading: str
) -> None:
    ref = DOC["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    schema = SCHEMAS[ref["$ref"].rsplit("/", 1)[1]]
    assert differences(declared(model), set(schema["properties"]), "/openapi.json") == []
    for name in refused(model):
        assert schema["properties"][name]["description"].startswith(REFUSED), name


@pytest.mark.parametrize(("path", "method", "model", "heading"), BODIES, ids=lambda x: str(x))
def test_every_body_field_is_in_the_api_docs(
    path: str, method: str, model: type[msgspec.Struct], heading: str
) -> None:
    rows = doc_tables(heading, "| Field |")
    accepted = declared(model)
    if model in (CompletionBody, ChatBody):  # one table for both endpoints
        accepted = declared(CompletionBody) | declared(ChatBody)
    assert differences(accepted, set(rows), f"docs/api.md ({heading})") == []
    for name in refused(model):
        assert "not supported" in rows[name].lower(), f"{name}: refused, documented as accepted"


def test_sampling_params_are_in_openapi_the_docs_and_the_engine() -> None:
    accepted = declared(SamplingParamsBody)
    assert differences(accepted, set(SCHEMAS["SamplingParams"]["properties"]), "openapi") == []
    rows = doc_tables("### Sampling parameters", "| Key | Type | Default | Rule")
    assert differences(accepted, set(rows), "docs/api.md (Sampling parameters)") == []
    engine = {f.name for f in dataclasses.fields(SamplingParams)}
    assert differences(accepted, engine, "engine.SamplingParams") == []
    for name in refused(SamplingParamsBody):
        assert "not supported" in rows[name].lower(), name


def sample(schema: dict[str, Any]) -> Any:
    """A value of the documented type (and range) of one field."""
    if "$ref" in schema:
        target = SCHEMAS[schema["$ref"].rsplit("/", 1)[1]]
        return {k: sample(target["properties"][k]) for k in target.get("required", [])}
    if "examples" in schema:
        return schema["examples"][0]
    if "enum" in schema:
        return schema["enum"][0]
    if "anyOf" in schema:
        return sample(next(s for s in schema["anyOf"] if s.get("type") != "null"))
    kind = schema.get("type")
    if kind == "array":
        return [sample(schema["items"])]
    if kind == "object":
        return {}
    return {
        "string": "x",
        "integer": schema.get("minimum", 1),
        "number": 0.5,
        "boolean": False,
    }[kind]


#: A field that needs another to be set with it.
WITH = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True}}
#: The least body of each endpoint; a field under test is added to it.
PARSERS = {
    "GenerateRequest": (lambda b: normalize_generate(b, vocab_size=VOCAB), {"text": "x"}),
    "CompletionRequest": (lambda b: parse_completion(b, vocab_size=VOCAB), {"prompt": "x"}),
    "ChatCompletionRequest": (
        lambda b: parse_chat(b, vocab_size=VOCAB),
        {"messages": [{"role": "user", "content": "x"}]},
    ),
}
MODELS = {
    "GenerateRequest": GenerateBody,
    "CompletionRequest": CompletionBody,
    "ChatCompletionRequest": ChatBody,
}


def cases() -> list[tuple[str, str, str]]:
    out = [
        (component, "body", name)
        for component, model in MODELS.items()
        for name in sorted(declared(model))
    ]
    return out + [
        ("GenerateRequest", "sampling_params", name)
        for name in sorted(declared(SamplingParamsBody))
    ]


@pytest.mark.parametrize(("component", "where", "name"), cases())
def test_a_documented_field_is_accepted_and_a_refused_one_refused(
    component: str, where: str, name: str
) -> None:
    parse, least = PARSERS[component]
    if where == "sampling_params":
        model, prop = SamplingParamsBody, SCHEMAS["SamplingParams"]["properties"][name]
    else:
        model, prop = MODELS[component], SCHEMAS[component]["properties"][name]
    value = "x" if name in refused(model) else sample(prop)
    field = {"sampling_params": {name: value}} if where == "sampling_params" else {name: value}
    body = {**least, **WITH.get(name, {}), **field}
    if name in refused(model):
        with pytest.raises(BadRequest, match=f"^{name} is not supported by this server yet."):
            parse(body)
    else:
        parse(body)  # no 400: the documented value is accepted
