"""`GET /openapi.json`: an OpenAPI 3.1 document describing every route the app serves.

Synopsis::

    doc = openapi_document(version="0.1.0")
    doc["paths"]["/generate"]["post"]["requestBody"]

One hand-written source, checked two ways: `tests/app/test_openapi.py` compares its paths and
methods with the app's own `url_map` (a route added without a description, or a description
left behind by a removed route, fails), and `tests/app/test_schemathesis.py` runs
schemathesis against a live server with it (no 5xx; statuses, content types and bodies as
documented). docs/api.md stays the prose reference; field rules that depend on the model
(vocabulary, context length) are stated there, not here.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response

from tributary.engine.sampling import (
    MAX_STOP_CHARS,
    MAX_STOP_COUNT,
    MAX_STOP_REGEX_BYTES,
    MAX_STOP_REGEX_COUNT,
    MAX_STOP_TOKEN_IDS,
)

from .normalize import MAX_RID_LENGTH, MAX_TOKEN_IDS_LOGPROB
from .output import json_response

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
_POSITIVE: Schema = {"type": "integer", "minimum": 1}
_PENALTY: Schema = {"type": "number", "minimum": -2, "maximum": 2}
#: Token ids; the upper bound is the model's vocabulary size (/get_model_info).
_IDS: Schema = {"type": "array", "items": _COUNT}
_PROMPT_IDS: Schema = {"type": "array", "items": _COUNT, "minItems": 1}
_STRS: Schema = {"type": "array", "items": _STR}
_STR_OR_STRS: Schema = {"anyOf": [_STR, _STRS]}
#: The per-request bounds (docs/api.md; engine/sampling.py, app/normalize.py).
_STOPS: Schema = {
    "anyOf": [
        {"type": "string", "maxLength": MAX_STOP_CHARS},
        {
            "type": "array",
            "items": {"type": "string", "maxLength": MAX_STOP_CHARS},
            "maxItems": MAX_STOP_COUNT,
        },
    ]
}
_STOP_REGEXES: Schema = {
    "anyOf": [_STR, {"type": "array", "items": _STR, "maxItems": MAX_STOP_REGEX_COUNT}],
    "description": f"At most {MAX_STOP_REGEX_COUNT} patterns, each at most "
    f"{MAX_STOP_REGEX_BYTES} bytes of UTF-8.",
}
_STOP_IDS: Schema = {**_IDS, "maxItems": MAX_STOP_TOKEN_IDS}
_RID: Schema = {"type": "string", "maxLength": MAX_RID_LENGTH}
_LOGPROB_IDS: Schema = {**_IDS, "maxItems": MAX_TOKEN_IDS_LOGPROB, "uniqueItems": True}


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
        503: "The queue is full (with Retry-After) or the server is shutting down.",
    }
    return {str(s): {"description": reasons[s], "content": _json(_ref(error))} for s in statuses}


def _text(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/plain": {"schema": _STR}}}


_SAMPLING_PARAMS: Schema = {
    "type": ["object", "null"],
    "description": "SGLang's SamplingParams; an unknown key is a 400 (docs/api.md).",
    "properties": {
        "max_new_tokens": _nullable(_COUNT),
        "min_new_tokens": _COUNT,
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1}]},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "frequency_penalty": _PENALTY,
        "presence_penalty": _PENALTY,
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
        "stop": _nullable(_STOPS),
        "stop_token_ids": _nullable(_STOP_IDS),
        "stop_regex": _nullable(_STOP_REGEXES),
        "ignore_eos": _BOOL,
        "skip_special_tokens": _BOOL,
        "spaces_between_special_tokens": _BOOL,
        "no_stop_trim": _BOOL,
        "n": _POSITIVE,
        "stream_interval": _nullable(_POSITIVE),
        "logit_bias": _nullable({"type": "object", "additionalProperties": _NUM}),
        "sampling_seed": _nullable(_INT),
        "custom_params": _nullable({"type": "object"}),
        "regex": _nullable(_STR),
        "json_schema": _nullable(_STR),
        "ebnf": _nullable(_STR),
        "structural_tag": _nullable(_STR),
    },
    "additionalProperties": False,
}


def _per_prompt(schema: Schema) -> Schema:
    """A value for every prompt, or for a batch a list with one per prompt; null: default."""
    return {"anyOf": [schema, {"type": "array", "items": _nullable(schema)}, {"type": "null"}]}


_GENERATE_REQUEST: Schema = {
    "type": "object",
    "description": "SGLang's GenerateReqInput.",
    "anyOf": [{"required": ["text"]}, {"required": ["input_ids"]}],
    "properties": {
        "text": _STR_OR_STRS,
        "input_ids": {"anyOf": [_PROMPT_IDS, {"type": "array", "items": _PROMPT_IDS}]},
        "sampling_params": {"anyOf": [_ref("SamplingParams"), {"type": "array", "items": {}}]},
        "stream": _nullable(_BOOL),
        "rid": _nullable({"anyOf": [_RID, {"type": "array", "items": _RID}]}),
        "return_logprob": _per_prompt(_BOOL),
        "logprob_start_len": _per_prompt(_INT),
        "top_logprobs_num": {
            **_per_prompt(_INT),
            "description": "At most the server's --max-logprobs (20 by default).",
        },
        "token_ids_logprob": {
            "anyOf": [_LOGPROB_IDS, {"type": "array", "items": _LOGPROB_IDS}, {"type": "null"}]
        },
        "return_text_in_logprobs": _nullable(_BOOL),
        "custom_logit_processor": _per_prompt(_STR),
    },
}

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

_SAMPLING = _SAMPLING_PARAMS["properties"]

_OPENAI_COMMON: dict[str, Schema] = {
    "model": _nullable(_STR),
    "max_tokens": _nullable(_COUNT),
    "n": _nullable(_POSITIVE),
    **{
        key: _nullable(_SAMPLING[key])
        for key in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
    },
    "stop": _nullable(_STOPS),
    "stop_token_ids": _nullable(_STOP_IDS),
    "stop_regex": _nullable(_STOP_REGEXES),
    "logit_bias": _nullable({"type": "object", "additionalProperties": _NUM}),
    "seed": _nullable(_INT),
    "min_tokens": _nullable(_COUNT),
    "ignore_eos": _nullable(_BOOL),
    "skip_special_tokens": _nullable(_BOOL),
    "spaces_between_special_tokens": _nullable(_BOOL),
    "no_stop_trim": _nullable(_BOOL),
    "regex": _nullable(_STR),
    "ebnf": _nullable(_STR),
    "json_schema": _nullable(_STR),
    "response_format": _nullable({"type": "object", "required": ["type"]}),
    "stream": _nullable(_BOOL),
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": _BOOL}}),
    "user": _nullable(_STR),
    "rid": _nullable(_RID),
    "custom_params": _nullable({"type": "object"}),
    "custom_logit_processor": _nullable(_STR),
}

#: OpenAI's bound on alternatives per position.
_TOP_LOGPROBS: Schema = {"type": "integer", "minimum": 0, "maximum": 20}

_COMPLETION_REQUEST: Schema = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        **_OPENAI_COMMON,
        "prompt": {
            "anyOf": [_STR, _STRS, _PROMPT_IDS, {"type": "array", "items": _PROMPT_IDS}],
        },
        "echo": _nullable(_BOOL),
        "logprobs": _nullable(_TOP_LOGPROBS),
        "suffix": _nullable(_STR),
        "best_of": _nullable(_INT),
    },
}

_MESSAGE: Schema = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "user", "assistant"]},
        "content": {
            "anyOf": [
                _STR,
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {"type": {"const": "text"}, "text": _STR},
                    },
                },
            ]
        },
        "name": _STR,
    },
}

_MESSAGES: Schema = {"type": "array", "items": _ref("ChatMessage")}

_CHAT_REQUEST: Schema = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **_OPENAI_COMMON,
        "messages": _MESSAGES,
        "max_completion_tokens": _nullable(_COUNT),
        "logprobs": _nullable(_BOOL),
        "top_logprobs": _nullable(_TOP_LOGPROBS),
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

_TOKENIZE_REQUEST: Schema = {
    "type": "object",
    "description": "Exactly one of prompt and messages.",
    "properties": {
        "prompt": _STR_OR_STRS,
        "messages": _MESSAGES,
        "add_special_tokens": _nullable(_BOOL),
        "add_generation_prompt": _nullable(_BOOL),
        "model": _nullable(_STR),
    },
}

_DETOKENIZE_REQUEST: Schema = {
    "type": "object",
    "required": ["tokens"],
    "properties": {
        "tokens": {"anyOf": [_IDS, {"type": "array", "items": _IDS}]},
        "skip_special_tokens": _nullable(_BOOL),
        "model": _nullable(_STR),
    },
}

_ABORT_REQUEST: Schema = {
    "type": "object",
    "properties": {"rid": _nullable(_STR), "abort_all": _BOOL},
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
                "SamplingParams": _SAMPLING_PARAMS,
                "GenerateRequest": _GENERATE_REQUEST,
                "GenerateOutput": _GENERATE_OUTPUT,
                "Error": _ERROR,
                "SGLangErrorResponse": _SGLANG_ERROR_RESPONSE,
                "OpenAIError": _OPENAI_ERROR,
                "CompletionRequest": _COMPLETION_REQUEST,
                "ChatCompletionRequest": _CHAT_REQUEST,
                "ChatMessage": _MESSAGE,
                "Completion": _COMPLETION,
                "ChatCompletion": _CHAT_COMPLETION,
                "Model": _MODEL_CARD,
                "TokenizeRequest": _TOKENIZE_REQUEST,
                "DetokenizeRequest": _DETOKENIZE_REQUEST,
                "AbortRequest": _ABORT_REQUEST,
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
