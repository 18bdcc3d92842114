"""`response_format`: OpenAI's structured output, as the engine's `json_schema` grammar.

Synopsis::

    response_format_schema({"type": "json_object"})          # '{"type": "object"}'
    response_format_schema({"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "object"}}})
    response_format_schema({"type": "text"})                 # None: unconstrained

As SGLang does: the schema is `json.dumps`-ed with the default separators, `json_object` is
the schema `{"type": "object"}`, and `strict` is not looked at (the output always follows the
schema). The engine compiles the schema at submit, so a schema it cannot use is a 400 naming
the problem ("Invalid json_schema: ..."). Setting it beside the `regex`, `ebnf` or
`json_schema` extras is SGLang's "Only one of ..." 400, never a silent choice of one.
"""

from __future__ import annotations

import json
from typing import Any

from ..http.errors import InvalidRequest

__all__ = ["GRAMMAR_CONFLICT", "response_format_schema"]

#: SGLang's words (SamplingParams.verify) for two output constraints at once.
GRAMMAR_CONFLICT = "Only one of json_schema, regex, ebnf, or structural_tag can be set."

_TYPES = ("text", "json_object", "json_schema")


def response_format_schema(value: Any) -> str | None:
    """The JSON Schema (as a string) that `value` asks the output to follow; None for none.
    Raises `InvalidRequest` (param `response_format`) for a malformed value."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid(f"response_format must be an object, got {value!r}.")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        return json.dumps(_schema(value.get("json_schema")))
    if kind == "structural_tag":
        raise _invalid("response_format type 'structural_tag' is not supported by this server yet.")
    raise _invalid(
        "response_format.type must be one of "
        + ", ".join(f"'{t}'" for t in _TYPES)
        + f", got {kind!r}."
    )


def _schema(spec: Any) -> dict[str, Any]:
    if not isinstance(spec, dict):
        raise _invalid(
            "response_format.json_schema is required for a json_schema response format: "
            '{"name": ..., "schema": {...}}.'
        )
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise _invalid(f"response_format.json_schema.name must be a string, got {name!r}.")
    # SGLang's model field is `schema_` (aliased `schema`); both spellings reach it.
    schema = spec.get("schema", spec.get("schema_"))
    if schema is None:
        # SGLang's words, with the field named as the client spells it.
        raise _invalid(
            "response_format.json_schema.schema is required for json_schema "
            "response format request."
        )
    if not isinstance(schema, dict):
        raise _invalid(
            f"response_format.json_schema.schema must be a JSON Schema object, got {schema!r}."
        )
    return schema


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(message, param="response_format")
