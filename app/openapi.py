"""`GET /openapi.json`: an OpenAPI 3.1 document describing every route the app serves.

Synopsis::

    doc = openapi_document(version="0.1.0")
    doc["paths"]["/generate"]["post"]["requestBody"]

Request schemas are generated from the Structs bodies are converted through (app/*/models.py,
app/sglang/protocol.py, app/chat/messages.py, engine.SamplingParamsBody, the embedding bodies);
the rest is written here (the embedding routes' in openapi_embeddings.py). Checked by tests/app:
test_openapi.py against the app's `url_map` (a route without a description, or a description
without a route, fails), test_wire_fields.py against the Structs and docs/api.md (the prose
reference), test_schemathesis.py against a live server (no 5xx; answers as documented).
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response

from tributary.engine.wire import request_schemas

from .anthropic import REQUIRED, RESPONSES, anthropic_paths
from .anthropic import SCHEMAS as ANTHROPIC_SCHEMAS
from .chat.messages import ChatMessage
from .http.responses import json_response
from .openai.models import SCHEMAS as OPENAI_SCHEMAS
from .openapi_embeddings import EMBEDDING_REQUIRED, EMBEDDING_SCHEMAS, embedding_paths
from .sglang.protocol import SCHEMAS as SGLANG_SCHEMAS

__all__ = ["openapi_blueprint", "openapi_document"]

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


_INT: Schema = {"type": "integer"}
_NUM: Schema = {"type": "number"}
_BOOL: Schema = {"type": "boolean"}
_STR: Schema = {"type": "string"}
_COUNT: Schema = {"type": "integer", "minimum": 0}
#: Token ids; the upper bound is the model's vocabulary size (/get_model_info).
_IDS: Schema = {"type": "array", "items": _COUNT}


def _json(schema: Schema) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _answer(description: str, schema: Schema, *, stream: bool = False) -> dict[str, Any]:
    content = _json(schema)
    if stream:
        content["text/event-stream"] = {"schema": _STR}
    return {"description": description, "content": content}


def _errors(error: str, *statuses: int) -> dict[str, Any]:
    """The error responses of an operation, each in the `error` component's shape."""
    reasons = {
        400: "A malformed body, a field of the wrong type or value, or a limit exceeded.",
        401: "An API key (or, for admin routes, the admin key) is configured and not sent.",
        403: "A front's worker routes when it was started without --admin-api-key (off).",
        404: "No such model (or, for /remove_worker, no such worker).",
        408: "The request's deadline (--request-timeout, X-Request-Timeout) passed.",
        413: "The body is larger than --max-request-bytes.",
        500: "The model runner failed.",
        501: "A front (--worker-url) has no model of its own to render this with.",
        503: "The queue is full (with Retry-After) or the server is shutting down.",
    }
    return {str(s): {"description": reasons[s], "content": _json(_ref(error))} for s in statuses}


def _text(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/plain": {"schema": _STR}}}


_META_INFO: Schema = {
    "type": "object",
    "required": ["id", "finish_reason", "prompt_tokens", "completion_tokens"],
    "properties": {
        "id": _STR,
        "finish_reason": _nullable({"type": "object", "required": ["type"]}),
        "prompt_tokens": _INT,
        "completion_tokens": _INT,
        "cached_tokens": _INT,
        "weight_version": _STR,
        "e2e_latency": _NUM,
    },
}

_GENERATE_OUTPUT: Schema = {
    "type": "object",
    "required": ["text", "output_ids", "meta_info"],
    "properties": {"text": _STR, "output_ids": _IDS, "meta_info": _META_INFO},
}

_ERROR: Schema = {
    "type": "object",
    "description": "SGLang's error body.",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "code"],
            "properties": {"message": _STR, "code": _INT},
        }
    },
}

# What a full queue answers on /generate, and every error of /tokenize and /detokenize.
_SGLANG_ERROR_RESPONSE: Schema = {
    "type": "object",
    "description": "SGLang's ErrorResponse (its OpenAI layer's error body).",
    "required": ["object", "message", "type", "code"],
    "properties": {
        "object": {"const": "error"},
        "message": _STR,
        "type": _STR,
        "param": _nullable(_STR),
        "code": _INT,
    },
}

_OPENAI_ERROR: Schema = {
    "type": "object",
    "description": "OpenAI's error body.",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": _STR,
                "type": _STR,
                "param": _nullable(_STR),
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}

_USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT},
}


def _openai_object(kind: str, choice: Schema) -> Schema:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": _STR,
            "object": {"const": kind},
            "created": _INT,
            "model": _STR,
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE,
        },
    }


_COMPLETION: Schema = _openai_object(
    "text_completion",
    {"type": "object", "required": ["index", "text", "finish_reason"]},
)
_CHAT_COMPLETION: Schema = _openai_object(
    "chat.completion",
    {"type": "object", "required": ["index", "message", "finish_reason"]},
)

_MODEL_CARD: Schema = {
    "type": "object",
    "required": ["id", "object", "owned_by", "max_model_len"],
    "properties": {"id": _STR, "object": {"const": "model"}, "max_model_len": _INT},
}

_WORKER_REQUEST: Schema = {
    "type": "object",
    "required": ["url"],
    "properties": {"url": _STR, "kind": {"type": "string", "enum": ["sglang", "openai"]}},
}

_WORKER: Schema = {
    "type": "object",
    "required": ["url", "kind", "breaker", "healthy", "in_flight"],
    "properties": {
        "id": {
            "type": "integer",
            "minimum": 1,
            "description": "The worker's number in the fleet: what client errors and the "
            "`worker` label of /metrics name (a front's workers only).",
        },
        "url": _STR,
        "kind": _STR,
        "breaker": {"type": "string", "enum": ["closed", "open", "half_open"]},
        "healthy": _BOOL,
        "in_flight": _COUNT,
        "requests_total": _COUNT,
        "errors_total": _COUNT,
        "retries_total": _COUNT,
        "breaker_opened_total": _COUNT,
    },
}


def _worker_op(summary: str, *errors: int) -> dict[str, Any]:
    """`/add_worker` and `/remove_worker`: the worker as `?url=...&kind=...` or a body."""
    return {
        "summary": summary,
        "parameters": [
            {"name": "url", "in": "query", "required": False, "schema": _STR},
            {"name": "kind", "in": "query", "required": False, "schema": _STR},
        ],
        "requestBody": {"required": False, "content": _json(_ref("WorkerRequest"))},
        "responses": {
            "200": _answer("The worker's state.", _WORKER),
            **_errors("Error", 400, 401, 403, *errors),
        },
    }


#: The per-request deadline of the generation routes (docs/api.md).
_TIMEOUT_HEADER: dict[str, Any] = {
    "name": "X-Request-Timeout",
    "in": "header",
    "required": False,
    "description": "Seconds this request may take (positive, finite); only shortens "
    "--request-timeout. Past it: 408, or in a stream an error item then [DONE].",
    "schema": {"type": "number", "exclusiveMinimum": 0},
}


def _body(name: str) -> dict[str, Any]:
    return {"required": True, "content": _json(_ref(name))}


def _paths() -> dict[str, Any]:
    generate = {
        "summary": "SGLang's native generation: single, batch, n samples, or SSE",
        "parameters": [_TIMEOUT_HEADER],
        "requestBody": _body("GenerateRequest"),
        "responses": {
            "200": _answer(
                "One output, or for a batch an array (a failed item is an error entry); with "
                "`stream`, server-sent events ending in `data: [DONE]`.",
                {
                    "anyOf": [
                        _ref("GenerateOutput"),
                        {
                            "type": "array",
                            "items": {"anyOf": [_ref("GenerateOutput"), _ref("Error")]},
                        },
                    ]
                },
                stream=True,
            ),
            **_errors("Error", 400, 401, 408, 413, 500),
            "503": {
                "description": "The queue is full (with Retry-After) or the server is draining.",
                "content": _json({"anyOf": [_ref("Error"), _ref("SGLangErrorResponse")]}),
            },
        },
    }
    health = {"responses": {"200": _text("Serving."), "503": _text("Draining or failing.")}}
    model_info = {"responses": {"200": _answer("The served model.", {"type": "object"})}}
    server_info = {
        "responses": {"200": _answer("Settings and a scheduler snapshot.", {"type": "object"})}
    }
    flush = {
        "responses": {
            "200": _text("Cache flushed."),
            "400": _text("Requests were running or waiting, so nothing was flushed."),
            **_errors("Error", 401),
        }
    }

    def openai_op(name: str, request: str, answer: str) -> dict[str, Any]:
        return {
            "summary": f"OpenAI's {name}",
            "parameters": [_TIMEOUT_HEADER],
            "requestBody": _body(request),
            "responses": {
                "200": _answer(
                    f"A {name} object, or with `stream`, SSE chunks.", _ref(answer), stream=True
                ),
                **_errors("OpenAIError", 400, 401, 404, 408, 413, 500, 503),
            },
        }

    def tokens_op(request: str, answer: Schema) -> dict[str, Any]:
        return {
            "requestBody": _body(request),
            "responses": {
                "200": _answer("Token ids or text.", answer),
                **_errors("SGLangErrorResponse", 400, 401, 413),
            },
        }

    tokenize = tokens_op(
        "TokenizeRequest", {"type": "object", "required": ["tokens", "count", "max_model_len"]}
    )
    detokenize = tokens_op("DetokenizeRequest", {"type": "object", "required": ["text"]})
    return {
        "/generate": {"post": generate, "put": generate},
        "/health": {"get": health},
        "/health_generate": {"get": health},
        "/get_model_info": {"get": model_info},
        "/model_info": {"get": model_info},
        "/get_server_info": {"get": server_info},
        "/server_info": {"get": server_info},
        "/abort_request": {
            "post": {
                "summary": "Abort a request (and its batch items) by rid, or all",
                "requestBody": _body("AbortRequest"),
                "responses": {
                    "200": _text("Done (an unknown rid is not an error)."),
                    **_errors("Error", 400, 401, 413),
                },
            }
        },
        "/flush_cache": {"get": flush, "post": flush},
        "/list_workers": {
            "get": {
                "summary": "The workers a front serves from (empty on a server with a model)",
                "responses": {
                    "200": _answer(
                        "{workers: [...]}",
                        {
                            "type": "object",
                            "properties": {"workers": {"type": "array", "items": _WORKER}},
                        },
                    ),
                    **_errors("Error", 401, 403),
                },
            }
        },
        "/add_worker": {"post": _worker_op("Serve from one more worker (admin)")},
        "/remove_worker": {"post": _worker_op("Stop sending requests to a worker (admin)", 404)},
        "/get_load": {
            "get": {
                "summary": "SGLang's load report, one entry per data-parallel rank",
                "responses": {
                    "200": _answer(
                        "[{rid, http_worker_ipc, dp_rank, num_reqs, num_waiting_reqs, num_tokens}]",
                        {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["num_reqs", "num_waiting_reqs", "num_tokens"],
                                "properties": {
                                    "num_reqs": _COUNT,
                                    "num_waiting_reqs": _COUNT,
                                    "num_tokens": _COUNT,
                                },
                            },
                        },
                    ),
                    **_errors("Error", 401),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus text format, SGLang's metric names (docs/operations.md)",
                "responses": {
                    "200": _text("The metrics."),
                    "404": {
                        "description": "Served with --disable-metrics.",
                        "content": _json(_ref("Error")),
                    },
                    **_errors("Error", 401),
                },
            }
        },
        "/tokenize": {"post": tokenize},
        "/v1/tokenize": {"post": tokenize},
        "/detokenize": {"post": detokenize},
        "/v1/detokenize": {"post": detokenize},
        "/v1/completions": {"post": openai_op("completion", "CompletionRequest", "Completion")},
        "/v1/chat/completions": {
            "post": openai_op("chat completion", "ChatCompletionRequest", "ChatCompletion")
        },
        **anthropic_paths(_errors, _TIMEOUT_HEADER),
        **embedding_paths(_errors, _TIMEOUT_HEADER),
        "/v1/models": {
            "get": {
                "responses": {
                    "200": _answer(
                        "The served model.",
                        {
                            "type": "object",
                            "properties": {"data": {"type": "array", "items": _ref("Model")}},
                        },
                    ),
                    **_errors("OpenAIError", 401),
                }
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "parameters": [
                    {"name": "model_id", "in": "path", "required": True, "schema": _STR}
                ],
                "responses": {
                    "200": _answer("The served model's card.", _ref("Model")),
                    **_errors("OpenAIError", 401, 404),
                },
            }
        },
        "/openapi.json": {
            "get": {"responses": {"200": _answer("This document.", {"type": "object"})}}
        },
    }


# What the declarations leave to the semantic layer (a missing prompt is worded there, so the
# fields are optional in the Structs), stated for the document's reader.
_REQUIRED: dict[str, Schema] = {
    "GenerateRequest": {"anyOf": [{"required": ["text"]}, {"required": ["input_ids"]}]},
    "CompletionRequest": {"required": ["prompt"]},
    "ChatCompletionRequest": {"required": ["messages"]},
    "DetokenizeRequest": {"required": ["tokens"]},
    **EMBEDDING_REQUIRED,
    **REQUIRED,
}


def _request_schemas() -> dict[str, Schema]:
    """Every request body's schema, generated from its declaration."""
    declared = {**SGLANG_SCHEMAS, **OPENAI_SCHEMAS, **ANTHROPIC_SCHEMAS, **EMBEDDING_SCHEMAS}
    schemas = request_schemas({**declared, "ChatMessage": ChatMessage})
    for schema in schemas.values():
        _drop_empty_required(schema)
    for name, extra in _REQUIRED.items():
        schemas[name].update(extra)
    return schemas


def _drop_empty_required(schema: Any) -> None:
    """msgspec writes `"required": []` for a Struct whose fields all have defaults; it says
    nothing (and the document never had it), so it goes, at any depth."""
    if isinstance(schema, dict):
        if schema.get("required") == []:
            del schema["required"]
        for value in schema.values():
            _drop_empty_required(value)
    elif isinstance(schema, list):
        for value in schema:
            _drop_empty_required(value)


def openapi_document(*, version: str) -> dict[str, Any]:
    """The whole document; `version` is Tributary's."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Tributary",
            "version": version,
            "description": "SGLang's native API and OpenAI's /v1 on Trio. Reference: docs/api.md.",
        },
        "paths": _paths(),
        "components": {
            "schemas": {
                **_request_schemas(),
                "GenerateOutput": _GENERATE_OUTPUT,
                "Error": _ERROR,
                "SGLangErrorResponse": _SGLANG_ERROR_RESPONSE,
                "OpenAIError": _OPENAI_ERROR,
                **RESPONSES,
                "Completion": _COMPLETION,
                "ChatCompletion": _CHAT_COMPLETION,
                "Model": _MODEL_CARD,
                "WorkerRequest": _WORKER_REQUEST,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        # The key is needed only when the server has one (--api-key); /health* never needs it.
        "security": [{}, {"bearer": []}],
    }


def openapi_blueprint(version: str) -> Blueprint:
    bp = Blueprint("tributary_openapi", __name__)
    document = openapi_document(version=version)

    @bp.route("/openapi.json", methods=["GET"])
    async def openapi() -> Response:
        return json_response(document)

    return bp
