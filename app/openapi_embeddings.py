"""The embedding routes' part of `/openapi.json` (app/openapi.py): `POST /v1/embeddings` and
SGLang's `/encode`, their request bodies (declared in app/openai/embeddings.py and
app/sglang/encode.py) and their answers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from .openai.embeddings import EmbeddingBody
from .sglang.encode import EncodeBody

__all__ = ["EMBEDDING_REQUIRED", "EMBEDDING_SCHEMAS", "embedding_paths"]

Schema = dict[str, Any]

#: The request bodies, by component name.
EMBEDDING_SCHEMAS: dict[str, type[msgspec.Struct]] = {
    "EmbeddingRequest": EmbeddingBody,
    "EncodeRequest": EncodeBody,
}

#: What the declarations leave to the parsers (the fields are optional in the Structs).
EMBEDDING_REQUIRED: dict[str, Schema] = {
    "EmbeddingRequest": {"required": ["input"]},
    "EncodeRequest": {"anyOf": [{"required": ["text"]}, {"required": ["input_ids"]}]},
}

_VECTOR: Schema = {"type": "array", "items": {"type": "number"}}
_INT: Schema = {"type": "integer"}

_EMBEDDINGS: Schema = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"const": "embedding"},
                    "index": _INT,
                    "embedding": {
                        "description": "L2-normalised; with encoding_format base64, the "
                        "little-endian float32 bytes in base64.",
                        "anyOf": [_VECTOR, {"type": "string"}],
                    },
                },
            },
        },
        "model": {"type": "string"},
        "usage": {
            "type": "object",
            "required": ["prompt_tokens", "total_tokens"],
            "properties": {"prompt_tokens": _INT, "total_tokens": _INT},
        },
    },
}

_ENCODE_OUTPUT: Schema = {
    "type": "object",
    "required": ["embedding", "meta_info"],
    "properties": {
        "embedding": _VECTOR,
        "meta_info": {
            "type": "object",
            "required": ["id", "prompt_tokens", "e2e_latency"],
            "properties": {
                "id": {"type": "string"},
                "prompt_tokens": _INT,
                "e2e_latency": {"type": "number"},
            },
        },
    },
}

_NO_EMBEDDINGS = (
    "This server computes no embeddings: a runner without them, or /encode at a front (a "
    "front relays /v1/embeddings to a worker)."
)


def _json(schema: Schema) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def embedding_paths(errors: Callable[..., dict[str, Any]], timeout: Schema) -> dict[str, Any]:
    """The two routes' path items; `errors(component, *statuses)` and the timeout header
    parameter are the document's own (app/openapi.py)."""

    def operation(summary: str, request: str, answer: Schema, error: str) -> dict[str, Any]:
        return {
            "summary": summary,
            "parameters": [timeout],
            "requestBody": {"required": True, "content": _json(_ref(request))},
            "responses": {
                "200": {"description": "The embeddings.", "content": _json(answer)},
                **errors(error, 400, 401, 408, 413, 500, 503),
                "501": {"description": _NO_EMBEDDINGS, "content": _json(_ref(error))},
            },
        }

    openai = operation("OpenAI's embeddings", "EmbeddingRequest", _EMBEDDINGS, "OpenAIError")
    openai["responses"].update(errors("OpenAIError", 404))
    encode = operation(
        "SGLang's native embeddings: one input, or a batch (an array of outputs)",
        "EncodeRequest",
        {"anyOf": [_ENCODE_OUTPUT, {"type": "array", "items": _ENCODE_OUTPUT}]},
        "Error",
    )
    return {"/v1/embeddings": {"post": openai}, "/encode": {"post": encode, "put": encode}}
