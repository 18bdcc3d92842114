"""Tools' parameter schemas: checked as JSON Schema, and moved into the forced-call schema.

Synopsis::

    check_parameters(0, tool, param="tools")   # 400 unless a valid draft 2020-12 schema
    call_array_schema([tool], named=True, parallel=False)
    # {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "object",
    #  "properties": {"name": {"type": "string", "enum": ["f"]}, "parameters": {...}}, ...}}

Every tool's parameters are checked when the request is read, whatever `tool_choice` is, as
SGLang's `_validate_request` does (`Draft202012Validator.check_schema`): llguidance ignores a
keyword whose value is malformed (`"maxLength": "5"`, `"items": 5`), so a forced call would
follow a schema other than the one the client meant, and a template would show the model one
that means nothing.

Forced calls (`required`, a named tool) hold the output to SGLang's array of `{"name",
"parameters"}` items, each tool's parameters inside its item. A local `$ref` is a JSON
pointer into the document it is written in, and the parameters are no longer a document's
root there: each `#`, `#/...` reference (`#/$defs/x`, draft-07's `#/definitions/x`,
`#/properties/a`, `#` itself for a recursive schema) is rewritten to point at where the
tool's parameters now sit (`#/items/anyOf/2/properties/parameters/...`), so the call's
`parameters` validates against the generated schema exactly when it validates against the
tool's own. Definitions stay where the tool wrote them, so two tools may use one name for
different definitions. A subschema with an `$id` is a resource of its own whose references
resolve within it, and is left as it is; an anchor (`#name`) names a place in the whole
document and is left too. A reference to another document (`http://...`, `other.json`) is a
400: this server fetches no schemas.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

from tributary.engine.grammar_bounds import MAX_JSON_DEPTH

from ..http.errors import InvalidRequest

__all__ = ["SchemaTool", "call_array_schema", "check_parameters"]

#: A schema-fault message is cut here (jsonschema quotes the offending value whole).
_MESSAGE_CHARS = 300
_NO_PARAMETERS = {"type": "object", "properties": {}}
#: Keywords whose value is a schema, or a list of schemas (draft-07's array `items` too).
_SUBSCHEMAS = frozenset(
    {
        "additionalItems", "additionalProperties", "allOf", "anyOf", "contains",
        "contentSchema", "else", "if", "items", "not", "oneOf", "prefixItems",
        "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties",
    }
)  # fmt: skip
#: Keywords whose value maps names to schemas (`dependencies`' lists of names are skipped).
_SCHEMA_MAPS = frozenset(
    {"$defs", "definitions", "dependencies", "dependentSchemas", "patternProperties", "properties"}
)


class SchemaTool(Protocol):
    """What the schema work reads of a tool (`ToolDefinition` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def parameters(self) -> dict[str, Any] | None: ...


def check_parameters(index: int, tool: SchemaTool, *, param: str) -> None:
    """A 400 naming the tool unless its parameters (None: it takes none) are a valid draft
    2020-12 JSON Schema no deeper than the grammar compiler reads (MAX_JSON_DEPTH)."""
    if tool.parameters is None:
        return
    where = f"{param}[{index}] ({tool.name!r})"
    depth = _depth(tool.parameters)
    if depth > MAX_JSON_DEPTH:
        raise InvalidRequest(
            f"{where}: the parameter schema is nested too deeply: {depth} levels of objects "
            f"and arrays, over the limit of {MAX_JSON_DEPTH}.",
            param=param,
        )
    try:
        error = _schema_fault(tool.parameters)
    except RecursionError:  # not seen within the bound (127 levels check), kept a 400 anyway
        error = "is nested too deeply to be checked"
    if error is not None:
        raise InvalidRequest(f"{where}: the parameter schema {error}.", param=param)


def _depth(value: Any) -> int:
    """How deeply JSON objects and arrays nest in `value` (walked without recursion)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


@functools.cache
def _meta_validator() -> Any:
    """A validator of draft 2020-12 schemas that finds what `check_schema` finds, about five
    times faster: the metaschema with its seven vocabularies merged into one schema and each
    `{"$dynamicRef": "#meta"}` a `{"$ref": "#"}` (what it resolves to when no metaschema
    extends this one, as none here does). jsonschema resolves the vocabularies' references
    at every subschema (0.4 ms each, 40 ms for a tool of 100 properties, on the event loop).
    Imported on first use: jsonschema takes about 50 ms to import, and only tools need it."""
    from jsonschema import Draft202012Validator
    from jsonschema_specifications import REGISTRY

    meta = Draft202012Validator.META_SCHEMA
    properties: dict[str, Any] = {}
    definitions: dict[str, Any] = {}
    for part in meta["allOf"]:  # {"$ref": "meta/core"}, ...
        vocabulary = REGISTRY.contents(f"https://json-schema.org/draft/2020-12/{part['$ref']}")
        properties.update(vocabulary["properties"])
        definitions.update(vocabulary.get("$defs", {}))
    properties.update(meta["properties"])  # the keywords of earlier drafts
    merged = {"type": ["object", "boolean"], "properties": properties, "$defs": definitions}
    return Draft202012Validator(_static(merged), format_checker=Draft202012Validator.FORMAT_CHECKER)


def _static(value: Any) -> Any:
    """The merged metaschema's references made local: `#meta` is its root, and a vocabulary's
    `meta/validation#/$defs/x` its own `#/$defs/x`."""
    if isinstance(value, list):
        return [_static(item) for item in value]
    if not isinstance(value, dict):
        return value
    out = {key: _static(item) for key, item in value.items() if key != "$dynamicRef"}
    if value.get("$dynamicRef") == "#meta":
        out["$ref"] = "#"
    if isinstance(value.get("$ref"), str):
        out["$ref"] = "#" + value["$ref"].partition("#")[2]
    return out


def _schema_fault(schema: dict[str, Any]) -> str | None:
    """What makes `schema` no valid draft 2020-12 schema (jsonschema's most relevant error, as
    `check_schema` finds them), or None."""
    from jsonschema.exceptions import best_match

    error = best_match(_meta_validator().iter_errors(schema))
    if error is None:
        return None
    message = error.message
    if len(message) > _MESSAGE_CHARS:
        message = message[: _MESSAGE_CHARS - 3] + "..."
    return f"is not a valid JSON Schema (draft 2020-12): at {error.json_path}: {message}"


def call_array_schema(
    tools: Sequence[SchemaTool], *, named: bool, parallel: bool
) -> dict[str, Any]:
    """SGLang's forced-call schema for `tools` (one, for a `named` tool choice): an array of at
    least one `{"name", "parameters"}` item (at most one without `parallel`), `anyOf` the
    tools' items, or the named tool's item alone. Each tool's local `$ref`s are rewritten to
    where its parameters now sit (module docstring)."""
    if named:
        (tool,) = tools
        items = {"type": "object", **_item_schema(tool, "/items")}
    else:
        items = {
            "type": "object",
            "anyOf": [_item_schema(tool, f"/items/anyOf/{i}") for i, tool in enumerate(tools)],
        }
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _item_schema(tool: SchemaTool, at: str) -> dict[str, Any]:
    """One tool's item, which sits at JSON pointer `at` in the forced-call schema."""
    parameters = tool.parameters if tool.parameters else _NO_PARAMETERS
    return {
        "properties": {
            "name": {"type": "string", "enum": [tool.name]},
            "parameters": _moved(parameters, f"{at}/properties/parameters", tool.name, "$"),
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _moved(schema: Any, base: str, tool: str, path: str) -> Any:
    """`schema` (a subschema of `tool`'s parameters at JSON path `path`) with its local JSON
    pointer `$ref`s rewritten to start at `base`, the parameters' pointer in the new document;
    a new object wherever anything changed, the client's left as they were (templates show
    them)."""
    if not isinstance(schema, dict) or "$id" in schema:
        return schema  # a boolean schema, or a resource of its own (module docstring)
    moved = dict(schema)
    ref = schema.get("$ref")
    if isinstance(ref, str):
        if ref == "#" or ref.startswith("#/"):
            moved["$ref"] = "#" + base + ref[1:]
        elif not ref.startswith("#"):
            raise InvalidRequest(
                f"Tool {tool!r}: the parameter schema refers to another document ($ref "
                f"{ref!r} at {path}): this server fetches no schemas; refer only within the "
                "tool's own schema ('#/$defs/...').",
                param="tools",
            )
    for key, value in schema.items():
        where = f"{path}.{key}"
        if key in _SUBSCHEMAS and isinstance(value, list):
            moved[key] = [_moved(v, base, tool, f"{where}[{i}]") for i, v in enumerate(value)]
        elif key in _SUBSCHEMAS:
            moved[key] = _moved(value, base, tool, where)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            moved[key] = {k: _moved(v, base, tool, f"{where}.{k}") for k, v in value.items()}
    return moved
