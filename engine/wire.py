"""Request bodies declared once, as msgspec Structs: one conversion, exact error wording.

Synopsis::

    class Body(msgspec.Struct, kw_only=True):
        n: Annotated[int | None, Meta(description="...", extra_json_schema={"minimum": 1})] = None

    body = convert(raw, Body, fault=lambda key, value: refuse(key, value))

A declaration is the single source of a body's fields: what the server accepts, their JSON
types, and (through `msgspec.json.schema_components`) the request schemas of /openapi.json.
Range rules are stated there for the reader (`extra_json_schema`), never enforced by msgspec:
the API's semantic layer checks them after conversion, in SGLang's order and words.

`convert` costs one `msgspec.convert` when the body is well typed. Only when it is not does it
convert field by field, in the order asked for (`declared`, the body's own (`body`), or a
key order of the API's own) and hand the first field that does not convert to
`fault(key, value)`, which returns a repaired value (a JSON `2.0` where an integer is declared)
or raises the API's error with its exact message. So a type error is worded by the API, never
by msgspec. A required field that is missing converts as a null, in its place in the order: its
`fault` words it (the API's words for a null).

An API whose rules interleave type faults with cross-field checks (the batch shape of
/generate, OpenAI's stream_options after the sampling checks) uses `convert_pending` instead:
the faults are kept (`Pending`), worded by the API's table, and each rule raises those of the
fields it reads before reading them, so the body's first fault in the rules' order is the one
reported, and the rules themselves never re-check a declared type.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar

import msgspec

__all__ = ["Fault", "Pending", "convert", "convert_pending", "request_schemas"]

T = TypeVar("T", bound=msgspec.Struct)

#: `fault(key, value)`: the repaired value of a field that did not convert, or raises.
Fault = Callable[[str, Any], Any]


def convert(
    raw: dict[str, Any],
    model: type[T],
    *,
    fault: Fault,
    order: Literal["declared", "body"] | Sequence[str] = "declared",
    check: Callable[[str, Any], object] | None = None,
) -> T:
    """`raw` (a parsed JSON object) as `model`. Unknown keys are the model's business
    (`forbid_unknown_fields`): a caller that forbids them checks them before calling.

    `order`: "declared", "body" (the body's keys, then missing required ones) or the keys
    themselves (fields left out follow, declared order). `check(key, value)`, when given, runs
    on every field that did convert, on the slow path only: the value checks the caller runs
    after conversion anyway, run here in the same order as the faults, so that the first
    problem of the body is the one reported."""
    try:
        return msgspec.convert(raw, model)
    except msgspec.ValidationError:
        return _convert_fields(raw, model, fault, order, check)


class _Field:
    """One declared field: its Python name, whether it is required, and a
    one-field Struct holding its type. msgspec keeps a Struct's type information, so
    converting `{"v": value}` through it costs a fraction of `msgspec.convert(value, type)`,
    which reads the annotation anew on every call."""

    __slots__ = ("holder", "name", "required")

    def __init__(self, model: type[msgspec.Struct], info: msgspec.structs.FieldInfo) -> None:
        self.name = info.name
        self.required = info.required
        self.holder: Any = msgspec.defstruct(f"{model.__name__}_{info.name}", [("v", info.type)])


class _Table:
    """A model's fields by JSON name, in declared order, and the required ones."""

    __slots__ = ("fields", "required")

    def __init__(self, model: type[msgspec.Struct]) -> None:
        self.fields = {f.encode_name: _Field(model, f) for f in msgspec.structs.fields(model)}
        self.required = tuple(k for k, f in self.fields.items() if f.required)


@functools.cache
def _table(model: type[msgspec.Struct]) -> _Table:
    """`model`'s field table, built once: `msgspec.structs.fields` evaluates every field's
    annotation anew on each call (about a millisecond for a large model)."""
    return _Table(model)


def _convert_fields(
    raw: dict[str, Any],
    model: type[T],
    fault: Fault,
    order: Literal["declared", "body"] | Sequence[str],
    check: Callable[[str, Any], object] | None,
) -> T:
    """`convert`'s slow path, for a body that did not convert whole: field by field."""
    table = _table(model)
    fields = table.fields
    if order == "body":
        keys: Iterable[str] = [*raw, *(k for k in table.required if k not in raw)]
    elif order == "declared":
        keys = fields
    else:
        keys = [*order, *(k for k in fields if k not in order)]
    values: dict[str, Any] = {}
    for key in keys:
        field = fields.get(key)
        if field is None:
            continue
        if key in raw:
            value = raw[key]
        elif field.required:
            value = None  # missing: as a null, worded by `fault`
        else:
            continue
        try:
            values[field.name] = msgspec.convert({"v": value}, field.holder).v
        except msgspec.ValidationError:
            values[field.name] = fault(key, value)
        else:
            if check is not None:
                check(key, values[field.name])
    return model(**values)


class Pending:
    """The fields of one body that did not convert, kept as sent, for an API whose rules mix
    type and cross-field checks: each rule first raises the faults of the fields it reads
    (`raise_for`), so that a body with several faults reports the one those rules meet first.

    `words(key, value, *context)` is the API's table: the exception for a value that is not
    of the field's type, or None for one that is and breaks only a bound the declaration
    states (the rules word that one), or for a field another layer words."""

    __slots__ = ("sent", "words")

    def __init__(self, words: Callable[..., Exception | None]) -> None:
        self.words = words
        self.sent: dict[str, Any] = {}

    def __call__(self, key: str, value: Any) -> Any:
        """`convert`'s fault: the value as sent, remembered when it is a type fault."""
        if self.words(key, value) is not None:
            self.sent[key] = value
        return value

    def raise_for(self, key: str, *context: Any) -> None:
        """Raise the type fault of `key`, if it has one."""
        if self.sent and key in self.sent:
            exc = self.words(key, self.sent[key], *context)
            if exc is not None:
                raise exc


#: The faults of a body that converted: none.
_NONE = Pending(lambda key, value: None)


def convert_pending(
    raw: dict[str, Any], model: type[T], words: Callable[..., Exception | None]
) -> tuple[T, Pending]:
    """`raw` as `model`, and its fields' type faults for the API's rules to raise in their
    order (`Pending`). One `msgspec.convert` when the body is well typed."""
    try:
        return msgspec.convert(raw, model), _NONE
    except msgspec.ValidationError:
        pending = Pending(words)
        return _convert_fields(raw, model, pending, "declared", None), pending


def request_schemas(models: dict[str, type[msgspec.Struct]]) -> dict[str, Any]:
    """The JSON Schemas of `models` (and of the Structs they hold), each under the component
    name it is given (a Struct's own name where it is not), referencing each other as
    OpenAPI components."""
    _, components = msgspec.json.schema_components(
        list(models.values()), ref_template="#/components/schemas/{name}"
    )
    names = {model.__name__: name for name, model in models.items()}
    text = json.dumps(components)
    for old, new in names.items():
        text = text.replace(f'"#/components/schemas/{old}"', f'"#/components/schemas/{new}"')
    schemas: dict[str, Any] = json.loads(text)
    out = {}
    for old, schema in schemas.items():
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            if prop.get("default", ...) is None:
                del prop["default"]  # null is the same as absent: nothing to tell
        out[names.get(old, old)] = schema
    return out
