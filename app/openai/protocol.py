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

The fields are declared once, in models.py (`CompletionBody`, `ChatBody`); a body is converted
through its declaration in one call, and what is here is OpenAI's and SGLang's rules, in their
order and words. A field not of its declared type is worded by `_words` (the sampling keys by
SamplingParams), and raised where the rules below read it (`Pending.raise_for`): a body with
several faults reports the first these rules meet. Unknown keys are ignored, as SGLang and
vLLM do; keys that would change the answer and that this server cannot honour (tools, suffix,
non-text content, ...) are a 400 rather than silently dropped. Every failure raises
`InvalidRequest` or an `engine.BadRequest`; nothing is submitted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from msgspec import UNSET

from tributary.engine import BadRequest, LogprobRequest, SamplingParams
from tributary.engine.wire import Pending, convert_pending

from ..chat.messages import parse_messages
from ..chat.tools import OutputSetup, ReasoningSetup, ToolCalling
from ..generation import check_rid
from ..http.errors import InvalidRequest
from .models import MAX_TOP_LOGPROBS, SAMPLING_KEYS, ChatBody, CompletionBody, OpenAIBody
from .response_format import GRAMMAR_CONFLICT, response_format_schema
from .tools import parse_reasoning_effort, parse_tool_choice, parse_tools

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "OpenAIRequest",
    "parse_chat",
    "parse_completion",
]

#: OpenAI's default `max_tokens` for /v1/completions.
COMPLETION_MAX_TOKENS = 16

#: A forced call is a grammar of its own (SGLang ignores its tool constraint, with a warning).
FORCED_CONFLICT = (
    "tool_choice 'required' or a named function constrains the output to tool calls; it "
    "cannot be combined with response_format, regex, ebnf or json_schema."
)


def _set(value: Any) -> bool:
    return value is not None and value != [] and value != {}


# Keys that would change the answer and that this server cannot honour, each with "is it in
# use?" (models.py declares them; tests/app/test_wire_fields.py sees each one refused).
_UNSUPPORTED_COMMON: dict[str, Callable[[Any], bool]] = {
    "lora_path": _set,
}
_UNSUPPORTED_COMPLETION: dict[str, Callable[[Any], bool]] = {
    **_UNSUPPORTED_COMMON,
    "suffix": lambda v: bool(v),
}
_UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {
    **_UNSUPPORTED_COMMON,
    "functions": _set,
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
    messages: list[dict[str, Any]]
    #: What the request asked of tools (None: it declared none and chose none).
    tools: ToolCalling | None = None
    #: `chat_template_kwargs` and `reasoning_effort`, for the template (None: none).
    template_extra: dict[str, Any] | None = None
    #: How the output is read for calls and reasoning; None on the plain path.
    output: OutputSetup | None = None


_STRING, _BOOLEAN, _INTEGER = (str, "a string"), (bool, "a boolean"), (int, "an integer")
_OBJECT = (dict, "an object")
#: The fields this layer words a type fault of: key -> (their JSON type, its name).
_KINDS = {
    "model": _STRING,
    "rid": _STRING,
    "custom_logit_processor": _STRING,
    "user": _STRING,
    "stream": _BOOLEAN,
    "echo": _BOOLEAN,
    "parallel_tool_calls": _BOOLEAN,
    "separate_reasoning": _BOOLEAN,
    "chat_template_kwargs": _OBJECT,
    "max_tokens": _INTEGER,
    "max_completion_tokens": _INTEGER,
}


def _words(
    key: str, value: Any, most: int = MAX_TOP_LOGPROBS, *, counts: tuple[str, ...] = ()
) -> InvalidRequest | None:
    """The 400 for a field that did not convert; None for a value of the field's type out of
    its declared bounds (the rules word it) and for the sampling keys (SamplingParams does)."""
    kind, name = _INTEGER if key in counts else _KINDS.get(key, (None, ""))
    if kind is None or (isinstance(value, kind) and (kind is bool or type(value) is not bool)):
        return None  # SamplingParams' key, or in the type but out of bounds
    if key in counts:
        return InvalidRequest(
            f"{key} must be an integer between 0 and {most}, got {value!r}.", param=key
        )
    return InvalidRequest(f"{key} must be {name}, got {value!r}.", param=key)


def _completion_words(key: str, value: Any, most: int = MAX_TOP_LOGPROBS) -> Any:
    return _words(key, value, most, counts=("logprobs",))


def _chat_words(key: str, value: Any, most: int = MAX_TOP_LOGPROBS) -> Any:
    if key == "logprobs":
        return InvalidRequest(f"logprobs must be a boolean, got {value!r}.", param=key)
    if key == "reasoning_effort":
        try:
            parse_reasoning_effort(value)
        except InvalidRequest as exc:
            return exc
    return _words(key, value, most, counts=("top_logprobs",))


def parse_completion(
    raw: Any, *, vocab_size: int, max_logprobs: int = MAX_TOP_LOGPROBS
) -> CompletionRequest:
    body, pending = convert_pending(_object(raw), CompletionBody, _completion_words)
    _reject_unsupported(body, _UNSUPPORTED_COMPLETION)
    max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is UNSET else body.max_tokens
    common = _common(body, pending, raw, max_tokens, "max_tokens", vocab_size)
    best_of = body.best_of
    if best_of is not None and best_of != common["n"]:
        raise InvalidRequest("best_of is not supported by this server yet.", param="best_of")
    pending.raise_for("echo")
    echo = bool(body.echo)
    top = _top_count(pending, "logprobs", body.logprobs, max_logprobs)
    logprobs = None
    if top is not None:
        # SGLang: the prompt is scored only when echo shows it and alternatives are asked for.
        logprobs = LogprobRequest(start_len=0 if echo and top > 0 else -1, top_n=top)
    return CompletionRequest(prompts=_prompts(body.prompt), echo=echo, logprobs=logprobs, **common)


def parse_chat(
    raw: Any,
    *,
    vocab_size: int,
    max_logprobs: int = MAX_TOP_LOGPROBS,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> ChatRequest:
    """`tool_call_parser`, `reasoning_parser`: the server's (`--tool-call-parser`,
    `--reasoning-parser`)."""
    body, pending = convert_pending(_object(raw), ChatBody, _chat_words)
    _reject_unsupported(body, _UNSUPPORTED_CHAT)
    messages = parse_messages(body.messages)
    tools, extra, output = _tools_and_reasoning(body, pending, tool_call_parser, reasoning_parser)
    forced = tools.constraint() if tools is not None and tools.forced else None
    # SGLang keeps special tokens whenever tools are on: call markers may be special tokens.
    keep_special = tools is not None and tools.choice != "none" and "skip_special_tokens" not in raw
    max_tokens: int | None
    if body.max_completion_tokens is not None:
        max_key, max_tokens = "max_completion_tokens", body.max_completion_tokens
    else:
        max_key, max_tokens = "max_tokens", None if body.max_tokens is UNSET else body.max_tokens
    common = _common(
        body, pending, raw, max_tokens, max_key, vocab_size, forced, keep_special=keep_special
    )
    pending.raise_for("logprobs")
    wanted = bool(body.logprobs)
    top = _top_count(pending, "top_logprobs", body.top_logprobs, max_logprobs)
    if top is not None and not wanted:
        raise InvalidRequest(
            "top_logprobs can only be set when logprobs is true.", param="top_logprobs"
        )
    logprobs = LogprobRequest(top_n=top or 0) if wanted else None
    return ChatRequest(
        messages=messages,
        logprobs=logprobs,
        tools=tools,
        template_extra=extra,
        output=output,
        **common,
    )


def _tools_and_reasoning(
    body: ChatBody, pending: Pending, tool_call_parser: str | None, reasoning_parser: str | None
) -> tuple[ToolCalling | None, dict[str, Any] | None, OutputSetup | None]:
    """The request's tools, the template's extra variables and how its output is read (None,
    None, None for a plain chat on a server without a reasoning parser)."""
    if (
        body.tools is None
        and body.tool_choice is None
        and body.reasoning_effort is None
        and not body.chat_template_kwargs
        and body.parallel_tool_calls is None
        and body.separate_reasoning is None
        and reasoning_parser is None
    ):
        return None, None, None  # the plain path: nothing to read (a type fault is not None)
    tools = parse_tools(body.tools)
    choice = parse_tool_choice(body.tool_choice, tools)
    pending.raise_for("parallel_tool_calls")
    parallel = body.parallel_tool_calls is not False
    calling = ToolCalling(tuple(tools), choice, parallel, tool_call_parser) if tools else None
    pending.raise_for("reasoning_effort")
    effort = parse_reasoning_effort(body.reasoning_effort)
    pending.raise_for("chat_template_kwargs")
    kwargs = dict(body.chat_template_kwargs or {})
    if "reasoning_effort" in kwargs:  # SGLang moves it to the request's field
        effort = parse_reasoning_effort(kwargs.pop("reasoning_effort"))
    elif effort is not None:  # SGLang: "none" turns thinking off unless the kwargs say
        kwargs.setdefault("thinking", effort != "none")
        kwargs.setdefault("enable_thinking", effort != "none")
    extra = {"reasoning_effort": effort, **kwargs} if effort is not None else kwargs
    pending.raise_for("separate_reasoning")
    reasoning = None
    if reasoning_parser is not None and body.separate_reasoning is not False:
        thinking = all(extra.get(key) is not False for key in ("enable_thinking", "thinking"))
        reasoning = ReasoningSetup(reasoning_parser, thinking=thinking)
    output = OutputSetup(calling, reasoning)
    return calling, extra or None, output if output.active else None


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


def _reject_unsupported(body: OpenAIBody, table: dict[str, Callable[[Any], bool]]) -> None:
    for key, in_use in table.items():
        value = getattr(body, key)
        if value is not None and in_use(value):
            raise InvalidRequest(f"{key} is not supported by this server yet.", param=key)


def _top_count(pending: Pending, key: str, value: int | None, max_logprobs: int) -> int | None:
    """OpenAI's bound (20), or the server's `--max-logprobs` when lower."""
    if value is None:
        return None
    most = min(MAX_TOP_LOGPROBS, max_logprobs)
    pending.raise_for(key, most)
    if not 0 <= value <= most:
        raise InvalidRequest(
            f"{key} must be an integer between 0 and {most}, got {value!r}.", param=key
        )
    return value


def _common(
    body: OpenAIBody,
    pending: Pending,
    sent: dict[str, Any],
    max_tokens: int | None,
    max_key: str,
    vocab_size: int,
    forced: str | None = None,
    *,
    keep_special: bool = False,
) -> dict[str, Any]:
    """What both endpoints take; `sent` is the body as sent (which keys it has). `forced`:
    the forced-call schema (chat's tool_choice), a json_schema no other constraint may join;
    `keep_special`: skip_special_tokens off."""
    pending.raise_for("model")
    pending.raise_for(max_key)
    if max_tokens is not None and max_tokens < 0:
        raise InvalidRequest(f"{max_key} must be at least 0, got {max_tokens}.", param=max_key)
    raw: dict[str, Any] = {"max_new_tokens": max_tokens, "n": body.n}
    for key, target in SAMPLING_KEYS.items():
        if key in sent:
            raw[target] = getattr(body, key)
    schema = response_format_schema(body.response_format)
    if schema is not None:
        if raw.get("json_schema"):
            raise InvalidRequest(GRAMMAR_CONFLICT, param="response_format")
        raw["json_schema"] = schema
    if forced is not None:
        if schema is not None or any(raw.get(k) for k in ("json_schema", "regex", "ebnf")):
            raise InvalidRequest(FORCED_CONFLICT, param="tool_choice")
        raw["json_schema"] = forced
    if keep_special:
        raw["skip_special_tokens"] = False
    sampling = SamplingParams.from_dict(raw)
    sampling.verify(vocab_size)
    pending.raise_for("stream")
    stream = bool(body.stream)
    options = body.stream_options
    include_usage = False
    if options is not None:
        if not stream:
            raise InvalidRequest(
                "stream_options can only be set when stream is true.", param="stream_options"
            )
        if not isinstance(options, dict):
            raise InvalidRequest("stream_options must be an object.", param="stream_options")
        usage = options.get("include_usage")  # inside an object declared as any
        if usage is not None and not isinstance(usage, bool):
            raise InvalidRequest(
                f"include_usage must be a boolean, got {usage!r}.", param="include_usage"
            )
        include_usage = bool(usage)
    pending.raise_for("rid")
    rid = body.rid
    try:
        check_rid(rid)
    except BadRequest as exc:
        raise InvalidRequest(str(exc), param="rid") from None
    pending.raise_for("custom_logit_processor")
    pending.raise_for("user")
    return {
        "model": body.model,
        "sampling": sampling if sampling.n == 1 else dataclasses.replace(sampling, n=1),
        "n": sampling.n,
        "stream": stream,
        "include_usage": include_usage,
        "rid": rid,
        "custom_logit_processor": body.custom_logit_processor,
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
