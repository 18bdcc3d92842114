"""Parsing `/v1/completions` and `/v1/chat/completions` bodies into checked requests.

Synopsis::

    req = parse_completion(body, vocab_size=eng.model_info.vocab_size)
    req.prompts        # list[str | list[int]], one entry per prompt, in request order
    req.sampling       # engine.SamplingParams for ONE sample (n is req.n)
    req.logprobs       # engine.LogprobRequest, or None

    req = parse_chat(body, vocab_size=...)
    req.messages       # [{"role": ..., "content": str}, ...] ready for the chat template

Mapping onto SGLang's sampling parameters (as SGLang's OpenAI adapter does): `max_tokens`
(chat: `max_completion_tokens` first) -> `max_new_tokens`, `seed` -> `sampling_seed`,
`min_tokens` -> `min_new_tokens`, `response_format` -> `json_schema` (response_format.py);
`temperature`, `top_p`, `presence_penalty`, `frequency_penalty`, `logit_bias`, `stop` and the
SGLang extras (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
`stop_regex`, `skip_special_tokens`, `no_stop_trim`, `spaces_between_special_tokens`, `regex`,
`json_schema`, `ebnf`, `custom_params`) keep their names and the engine's validation and
messages; `custom_logit_processor` goes to the request. `max_tokens` defaults to 16 on
completions (OpenAI's default) and to "until the context is full" on chat; an explicit null
means the latter.

Logprobs: completions' `logprobs: N` (0..20) scores the output with N alternatives, and with
`echo` and N > 0 the prompt too (SGLang's `logprob_start_len = 0 if echo and logprobs`);
chat's `logprobs: true` with `top_logprobs: N` (0..20; only with logprobs) the output. A
server started with a lower `--max-logprobs` lowers the 20 to that.

`rid` is at most `MAX_RID_LENGTH` (256) characters: it is echoed as every chunk's `id`.

Unknown keys are ignored, as SGLang and vLLM do; keys that would change the answer and that
this server cannot honour (tools, suffix, non-text content, ...) are a 400 rather than
silently dropped. Every failure raises `InvalidRequest` or an `engine.BadRequest`; nothing is
submitted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tributary.engine import BadRequest, LogprobRequest, SamplingParams

from ..normalize import check_rid
from .errors import InvalidRequest
from .messages import parse_messages
from .response_format import GRAMMAR_CONFLICT, response_format_schema

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "OpenAIRequest",
    "parse_chat",
    "parse_completion",
]

#: OpenAI's default `max_tokens` for /v1/completions.
COMPLETION_MAX_TOKENS = 16
#: The most alternatives per position (`logprobs`, `top_logprobs`): OpenAI's bound.
MAX_TOP_LOGPROBS = 20

# OpenAI key -> SamplingParams key, for every key passed straight through.
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "logit_bias": "logit_bias",
    "seed": "sampling_seed",
    "min_tokens": "min_new_tokens",
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
    "structural_tag": "structural_tag",  # the engine answers "not supported yet"
    "stop_regex": "stop_regex",
    "custom_params": "custom_params",
}


def _set(value: Any) -> bool:
    return value is not None and value != [] and value != {}


_UNSUPPORTED_COMMON: dict[str, Callable[[Any], bool]] = {
    "lora_path": _set,
}
_UNSUPPORTED_COMPLETION: dict[str, Callable[[Any], bool]] = {
    **_UNSUPPORTED_COMMON,
    "suffix": lambda v: bool(v),
}
_UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {
    **_UNSUPPORTED_COMMON,
    "tools": _set,
    "functions": _set,
    "tool_choice": lambda v: v not in (None, "none", "auto"),
    "function_call": lambda v: v not in (None, "none", "auto"),
    "audio": _set,
    "modalities": lambda v: v is not None and v != ["text"],
    "prediction": _set,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpenAIRequest:
    #: None when the client left `model` out (the served model is meant).
    model: str | None
    #: The sampling of one choice; `n` choices per prompt are submitted separately.
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    #: SGLang's `rid`; multi-choice requests fan it out as `rid_0`, `rid_1`, ...
    rid: str | None
    #: What to score (None: no logprobs).
    logprobs: LogprobRequest | None = None
    #: SGLang's serialized custom logit processor (the engine decides whether it may run).
    custom_logit_processor: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompletionRequest(OpenAIRequest):
    prompts: list[str | list[int]]
    echo: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatRequest(OpenAIRequest):
    messages: list[dict[str, str]]


def parse_completion(
    body: Any, *, vocab_size: int, max_logprobs: int = MAX_TOP_LOGPROBS
) -> CompletionRequest:
    body = _object(body)
    _reject_unsupported(body, _UNSUPPORTED_COMPLETION)
    max_tokens = body.get("max_tokens", COMPLETION_MAX_TOKENS)
    common = _common(body, max_tokens, "max_tokens", vocab_size)
    best_of = body.get("best_of")
    if best_of is not None and best_of != common["n"]:
        raise InvalidRequest("best_of is not supported by this server yet.", param="best_of")
    echo = _bool(body, "echo")
    top = _top_count(body, "logprobs", max_logprobs)
    logprobs = None
    if top is not None:
        # SGLang: the prompt is scored only when echo shows it and alternatives are asked for.
        logprobs = LogprobRequest(start_len=0 if echo and top > 0 else -1, top_n=top)
    return CompletionRequest(
        prompts=_prompts(body.get("prompt")), echo=echo, logprobs=logprobs, **common
    )


def parse_chat(body: Any, *, vocab_size: int, max_logprobs: int = MAX_TOP_LOGPROBS) -> ChatRequest:
    body = _object(body)
    _reject_unsupported(body, _UNSUPPORTED_CHAT)
    messages = parse_messages(body.get("messages"))
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    common = _common(body, body.get(key), key, vocab_size)
    wanted = _bool(body, "logprobs")
    top = _top_count(body, "top_logprobs", max_logprobs)
    if top is not None and not wanted:
        raise InvalidRequest(
            "top_logprobs can only be set when logprobs is true.", param="top_logprobs"
        )
    logprobs = LogprobRequest(top_n=top or 0) if wanted else None
    return ChatRequest(messages=messages, logprobs=logprobs, **common)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


def _reject_unsupported(body: dict[str, Any], table: dict[str, Callable[[Any], bool]]) -> None:
    for key, in_use in table.items():
        if key in body and in_use(body[key]):
            raise InvalidRequest(f"{key} is not supported by this server yet.", param=key)


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"{key} must be a boolean, got {value!r}.", param=key)
    return value


def _top_count(body: dict[str, Any], key: str, max_logprobs: int) -> int | None:
    """OpenAI's bound (20), or the server's `--max-logprobs` when lower."""
    value = body.get(key)
    if value is None:
        return None
    most = min(MAX_TOP_LOGPROBS, max_logprobs)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise InvalidRequest(
            f"{key} must be an integer between 0 and {most}, got {value!r}.", param=key
        )
    return value


def _common(body: dict[str, Any], max_tokens: Any, max_key: str, vocab_size: int) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"model must be a string, got {model!r}.", param="model")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
        raise InvalidRequest(f"{max_key} must be an integer, got {max_tokens!r}.", param=max_key)
    if max_tokens is not None and max_tokens < 0:
        raise InvalidRequest(f"{max_key} must be at least 0, got {max_tokens}.", param=max_key)
    raw: dict[str, Any] = {"max_new_tokens": max_tokens, "n": body.get("n")}
    for key, target in _SAMPLING_KEYS.items():
        if key in body:
            raw[target] = body[key]
    schema = response_format_schema(body.get("response_format"))
    if schema is not None:
        if raw.get("json_schema"):
            raise InvalidRequest(GRAMMAR_CONFLICT, param="response_format")
        raw["json_schema"] = schema
    sampling = SamplingParams.from_dict(raw)
    sampling.verify(vocab_size)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise InvalidRequest(
                "stream_options can only be set when stream is true.", param="stream_options"
            )
        if not isinstance(options, dict):
            raise InvalidRequest("stream_options must be an object.", param="stream_options")
        include_usage = _bool(options, "include_usage")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise InvalidRequest(f"rid must be a string, got {rid!r}.", param="rid")
    try:
        check_rid(rid)
    except BadRequest as exc:
        raise InvalidRequest(str(exc), param="rid") from None
    processor = body.get("custom_logit_processor")
    if processor is not None and not isinstance(processor, str):
        raise InvalidRequest(
            f"custom_logit_processor must be a string, got {processor!r}.",
            param="custom_logit_processor",
        )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest(f"user must be a string, got {user!r}.", param="user")
    return {
        "model": model,
        "sampling": dataclasses.replace(sampling, n=1),
        "n": sampling.n,
        "stream": stream,
        "include_usage": include_usage,
        "rid": rid,
        "custom_logit_processor": processor,
    }


def _prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's four prompt shapes, as one list of prompts."""
    if prompt is None:
        raise InvalidRequest("prompt is required.", param="prompt")
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and prompt and _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and _is_ids(p) for p in prompt)
    ):
        prompts = list(prompt)
    elif prompt == []:
        raise InvalidRequest("prompt cannot be empty.", param="prompt")
    else:
        raise InvalidRequest(
            "prompt must be a string, a list of strings, a list of token ids, or a list of "
            "lists of token ids.",
            param="prompt",
        )
    if any(len(p) == 0 for p in prompts):
        raise InvalidRequest("prompt cannot be empty.", param="prompt")
    return prompts


def _is_ids(values: list[Any]) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in values)
