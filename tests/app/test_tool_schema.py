"""Tools' parameter schemas (app/chat/tool_schema.py): a forced call's `parameters` validates
against the generated forced-call schema exactly when it validates against the tool's own
schema, whatever local `$ref`s the tool uses (checked with jsonschema on valid and invalid
arguments, and compiled by llguidance); parameters that are no valid JSON Schema are a 400
naming the tool and the fault, for every tool choice; and, on the real model, forced calls
of tools with such references validate against their tools' schemas."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from typing import Any

import httpx
import llguidance
import pytest
from apphelpers import Server
from jsonschema import Draft202012Validator
from openaihelpers import chat_body

from tributary.app.chat.tools import (
    NamedTool,
    ToolCalling,
    ToolChoice,
    ToolDefinition,
    check_tools,
    forced_call_schema,
)
from tributary.app.http.errors import InvalidRequest

pytest_plugins = ["openaifixtures"]  # model_server, http

#: A tree of nodes through `#`: the generated schema once read it as "an array of calls".
TREE = {
    "type": "object",
    "properties": {"v": {"type": "integer"}, "child": {"$ref": "#"}},
    "required": ["v"],
    "additionalProperties": False,
}
#: Draft-07 (pydantic v1) definitions.
DRAFT7 = {
    "type": "object",
    "properties": {"code": {"$ref": "#/definitions/code"}},
    "required": ["code"],
    "definitions": {"code": {"type": "string", "maxLength": 3}},
}
#: A reference to a sibling property.
SIBLING = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0}, "b": {"$ref": "#/properties/a"}},
}
POINT = {
    "type": "object",
    "properties": {"p": {"$ref": "#/$defs/point"}},
    "$defs": {
        "point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    },
}
#: Two tools defining one name differently.
SAME_A = {
    "type": "object",
    "properties": {"k": {"$ref": "#/$defs/k"}},
    "$defs": {"k": {"type": "string"}},
}
SAME_B = {
    "type": "object",
    "properties": {"k": {"$ref": "#/$defs/k"}},
    "$defs": {"k": {"type": "integer"}},
}
#: A resource of its own: its references resolve within it, as the tool wrote them.
RESOURCE = {
    "$id": "https://example.com/tool.json",
    "type": "object",
    "properties": {"s": {"$ref": "#/$defs/s"}},
    "$defs": {"s": {"type": "string", "minLength": 2}},
}
#: `{"$ref": "#"}` as a value (`const`) is data, not a reference.
DATA = {"type": "object", "properties": {"k": {"const": {"$ref": "#"}}}}  # fmt: skip

#: (parameters, arguments a valid call may carry, arguments it may not)
CASES: dict[str, tuple[dict[str, Any], list[Any], list[Any]]] = {
    "recursive-via-#": (
        TREE,
        [{"v": 1}, {"v": 1, "child": {"v": 2, "child": {"v": 3}}}],
        [{"child": {"v": 1}}, {"v": 1, "child": {"v": "x"}},
         {"v": 1, "child": [{"name": "t0", "parameters": {"v": 1}}]}, {"v": 1, "w": 2}],
    ),
    "draft-07-definitions": (
        DRAFT7, [{"code": "abc"}, {"code": ""}], [{"code": "abcd"}, {"code": 1}, {}]
    ),
    "#/properties/a": (
        SIBLING, [{"a": 0, "b": 5}, {"b": 0}, {}], [{"b": -1}, {"b": "x"}, {"a": -2}]
    ),
    "$defs": (POINT, [{"p": {"x": 1.5}}, {}], [{"p": {}}, {"p": {"x": "1"}}, {"p": 3}]),
    "same-def-names-a": (SAME_A, [{"k": "x"}, {}], [{"k": 1}]),
    "same-def-names-b": (SAME_B, [{"k": 1}, {}], [{"k": "x"}]),
    "$id-resource": (RESOURCE, [{"s": "ab"}, {}], [{"s": "a"}, {"s": 2}]),
    "$ref-as-data": (DATA, [{"k": {"$ref": "#"}}, {}], [{"k": {"$ref": "#/items"}}]),
}  # fmt: skip
TOOLS = [ToolDefinition(f"t{i}", None, case[0]) for i, case in enumerate(CASES.values())]


def compiles(schema: dict[str, Any]) -> str:
    """llguidance's verdict on a json_schema ("" if it compiles), as the engine converts it."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False}
    )
    return str(llguidance.LLMatcher.validate_grammar(grammar))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_call_validates_against_the_forced_schema_exactly_when_against_its_tools(
    case: str, choice: str
) -> None:
    tool = TOOLS[list(CASES).index(case)]
    parameters, valid, invalid = CASES[case]
    own = Draft202012Validator(parameters)
    assert all(own.is_valid(a) for a in valid) and not any(own.is_valid(a) for a in invalid)
    picked: ToolChoice = NamedTool(tool.name) if choice == "named" else "required"
    schema = forced_call_schema(TOOLS, picked, parallel=True)
    assert schema is not None
    forced = Draft202012Validator(schema)
    for arguments in valid + invalid:
        call = {"name": tool.name, "parameters": arguments}
        assert forced.is_valid([call]) == own.is_valid(arguments), (case, arguments)
    assert compiles(schema) == ""


def test_the_clients_parameters_are_left_as_they_were() -> None:
    # Templates render the tools as the client sent them.
    before = copy.deepcopy([t.parameters for t in TOOLS])
    forced_call_schema(TOOLS, "required", parallel=False)
    assert [t.parameters for t in TOOLS] == before


def test_references_point_where_the_parameters_now_sit() -> None:
    tree = ToolDefinition("tree", None, TREE)
    named = forced_call_schema([tree], NamedTool("tree"), parallel=True)
    assert named is not None
    assert named["items"]["properties"]["parameters"]["properties"]["child"] == {
        "$ref": "#/items/properties/parameters"
    }
    required = forced_call_schema([ToolDefinition("x"), tree], "required", parallel=True)
    assert required is not None
    moved = required["items"]["anyOf"][1]["properties"]["parameters"]
    assert moved["properties"]["child"] == {"$ref": "#/items/anyOf/1/properties/parameters"}
    assert "$defs" not in required  # definitions stay in their tool's parameters


@pytest.mark.parametrize(
    "ref", ["https://example.com/schema.json", "other.json#/x", "http://e.com/s#"]
)
def test_a_reference_to_another_document_is_a_400_for_forced_calls(ref: str) -> None:
    tool = ToolDefinition("f", None, {"type": "object", "properties": {"a": {"$ref": ref}}})
    check_tools([tool], param="tools")  # a valid schema: `auto` renders it as it is
    with pytest.raises(InvalidRequest) as caught:
        ToolCalling((tool,), "required").constraint()
    assert str(caught.value) == (
        f"Tool 'f': the parameter schema refers to another document ($ref {ref!r} at "
        "$.properties.a): this server fetches no schemas; refer only within the tool's own "
        "schema ('#/$defs/...')."
    )
    assert caught.value.param == "tools"


#: (parameters, where the fault is, what it is): the malformed keywords llguidance ignores.
BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"type": "string", "maxLength": "5"}, "$.maxLength", "'5' is not of type 'integer'"),
    ({"enum": "abc"}, "$.enum", "'abc' is not of type 'array'"),
    ({"type": "array", "items": 5}, "$.items", "5 is not of type 'object', 'boolean'"),
    ({"type": "object", "required": [1]}, "$.required[0]", "1 is not of type 'string'"),
    ({"type": "array", "minItems": -1}, "$.minItems", "-1 is less than the minimum of 0"),
    ({"type": "object", "properties": [1]}, "$.properties", "[1] is not of type 'object'"),
    ({"additionalProperties": "no"}, "$.additionalProperties", "'no' is not of type"),
    ({"properties": {"a": {"type": "objec"}}}, "$.properties.a.type", "'objec' is not valid"),
    ({"properties": {"a": {"pattern": "(a"}}}, "$.properties.a.pattern", "'(a' is not a 'regex'"),
]


@pytest.mark.parametrize(("parameters", "at", "fault"), BAD, ids=[b[1] for b in BAD])
def test_parameters_that_are_no_json_schema_are_a_400_naming_the_tool_and_fault(
    parameters: dict[str, Any], at: str, fault: str
) -> None:
    tools = [ToolDefinition("ok", None, TREE), ToolDefinition("bad", None, parameters)]
    with pytest.raises(InvalidRequest) as caught:
        check_tools(tools, param="tools")
    message = str(caught.value)
    assert message.startswith(
        f"tools[1] ('bad'): the parameter schema is not a valid JSON Schema (draft 2020-12): "
        f"at {at}: {fault}"
    ), message
    assert caught.value.param == "tools"


#: Schemas across every vocabulary's keywords, valid and not, for the merged metaschema.
CORPUS: list[Any] = [
    *(case[0] for case in CASES.values()), *(bad[0] for bad in BAD), True, {}, {"not": False},
    {"$schema": "https://json-schema.org/draft/2020-12/schema", "$comment": "c", "title": "t"},
    {"$id": "#frag"}, {"$id": "https://e.com/a.json"}, {"$anchor": "1bad"}, {"$anchor": "ok"},
    {"$dynamicRef": "#x", "$dynamicAnchor": "x"}, {"$vocabulary": {"https://e.com": True}},
    {"$vocabulary": {"https://e.com": 1}}, {"$ref": 5}, {"$defs": {"a": 5}},
    {"definitions": {"a": {"type": "string"}}}, {"definitions": {"a": []}},
    {"dependencies": {"a": ["b"], "c": {"required": ["d"]}}}, {"dependencies": {"a": [1]}},
    {"$recursiveRef": "#", "$recursiveAnchor": True}, {"$recursiveAnchor": "x"},
    {"items": [{"type": "string"}]}, {"prefixItems": [{"type": "string"}], "items": False},
    {"prefixItems": []}, {"allOf": [{}, {"oneOf": [{"anyOf": [{"type": "null"}]}]}]},
    {"allOf": [{}, {"oneOf": [{"anyOf": [{"type": "nul"}]}]}]},
    {"if": {"minimum": 1}, "then": {"maximum": 2}, "else": {"multipleOf": 0}},
    {"contains": {"const": 1}, "minContains": 1, "maxContains": -1},
    {"propertyNames": {"pattern": "^a"}, "patternProperties": {"(": {}}},
    {"dependentSchemas": {"a": 3}}, {"dependentRequired": {"a": ["b", "b"]}},
    {"unevaluatedProperties": {"type": "string"}, "unevaluatedItems": 1},
    {"type": ["string", "string"]}, {"type": []}, {"enum": []}, {"const": None},
    {"multipleOf": 0.5, "maximum": 1e9, "exclusiveMinimum": "0"}, {"uniqueItems": "yes"},
    {"minLength": 1.5}, {"maxLength": 2.0}, {"format": "date-time", "deprecated": 1},
    {"readOnly": True, "writeOnly": False, "examples": [1], "default": {"$ref": 1}},
    {"contentEncoding": "base64", "contentMediaType": 3, "contentSchema": {"type": "object"}},
    {"properties": {"a": {"properties": {"b": {"items": {"required": "c"}}}}}},
]  # fmt: skip


def test_the_check_finds_what_jsonschemas_check_schema_finds() -> None:
    # The check validates with the draft 2020-12 metaschema merged into one schema (faster):
    # it refuses exactly what `check_schema` refuses, at a place `check_schema` names (or
    # within it: the most relevant error may be one of an `anyOf`'s).
    real = Draft202012Validator(
        Draft202012Validator.META_SCHEMA, format_checker=Draft202012Validator.FORMAT_CHECKER
    )
    refused = 0
    for schema in CORPUS:
        errors = list(real.iter_errors(schema))
        tool = ToolDefinition("f", None, schema if isinstance(schema, dict) else {"not": schema})
        try:
            check_tools([tool], param="tools")
        except InvalidRequest as exc:
            refused += 1
            assert errors, (schema, str(exc))
            at = str(exc).partition(" at ")[2].partition(": ")[0]
            assert any(at.startswith(e.json_path) for e in errors), (schema, str(exc))
        else:
            assert not errors, (schema, errors[0].message)
    assert 20 < refused < len(CORPUS) - 20


def test_valid_schemas_and_none_pass_the_check() -> None:
    check_tools([*TOOLS, ToolDefinition("none"), ToolDefinition("empty", None, {})], param="t")


def test_parameters_too_deep_to_compile_or_check_are_a_400() -> None:
    deep: dict[str, Any] = {}
    for _ in range(70):  # 140 levels of objects
        deep = {"properties": {"x": deep}}
    with pytest.raises(InvalidRequest, match=r"^tools\[0\] \('f'\): the parameter schema is "
                       "nested too deeply: 141 levels of objects and arrays, over the limit "
                       "of 128.$"):  # fmt: skip
        check_tools([ToolDefinition("f", None, deep)], param="tools")
    chain: dict[str, Any] = {"type": "string", "maxLength": "5"}
    for _ in range(126):  # as deep as the bound allows: checked all the way down
        chain = {"not": chain}
    with pytest.raises(InvalidRequest, match=r"at \$(\.not){126}\.maxLength: '5' is not of"):
        check_tools([ToolDefinition("f", None, chain)], param="tools")


def test_jsonschema_is_imported_only_when_a_tool_has_parameters() -> None:
    # About 50 ms: a server that never sees tools never pays it, nor does a chat without them.
    script = """
import sys
from tributary.app.openai.protocol import parse_chat
parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, vocab_size=10)
parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}]}, vocab_size=10)
assert "jsonschema" not in sys.modules
parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
           vocab_size=10)
assert "jsonschema" in sys.modules
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)


def openai_tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.model
@pytest.mark.parametrize("choice", ["required", "code", "sibling", "point", "resource"])
async def test_forced_calls_with_references_validate_on_the_model(
    http: httpx.AsyncClient, model_server: Server, choice: str
) -> None:
    schemas = {"code": DRAFT7, "sibling": SIBLING, "point": POINT, "resource": RESOURCE}
    named = {"type": "function", "function": {"name": choice}}
    body = chat_body(
        model_server,
        "Look up the airport code of Paris.",
        tools=[openai_tool(name, schema) for name, schema in schemas.items()],
        tool_choice="required" if choice == "required" else named,
        max_tokens=200,
    )
    reply = await http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    [answer] = reply.json()["choices"]
    assert answer["finish_reason"] == "tool_calls", answer
    calls = answer["message"]["tool_calls"]
    assert calls
    for call in calls:
        name = call["function"]["name"]
        assert name == choice or choice == "required"
        Draft202012Validator(schemas[name]).validate(json.loads(call["function"]["arguments"]))


@pytest.mark.model
async def test_a_recursive_reference_nests_the_tools_own_object_on_the_model(
    http: httpx.AsyncClient, model_server: Server
) -> None:
    # SmolLM2 nests a recursive schema until max_tokens, so the call never closes; what it
    # wrote shows the grammar: `child` is a node (`{"v":...}`), where the `#` left as written
    # made it an array of calls (`[{"name":"tree",...`).
    body = chat_body(
        model_server,
        "Build a tree of numbers.",
        tools=[openai_tool("tree", TREE)],
        tool_choice={"type": "function", "function": {"name": "tree"}},
        max_tokens=40,
    )
    reply = await http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    [answer] = reply.json()["choices"]
    content = answer["message"]["content"]
    assert answer["finish_reason"] == "length", answer
    assert content.startswith('[{"name":"tree","parameters":{"v":'), content
    assert '"child":{"v":' in content and '"child":[' not in content, content
