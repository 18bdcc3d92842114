"""`/v1/completions` and `/v1/chat/completions` request bodies, declared once.

Synopsis::

    body = convert(raw, ChatBody, fault=...)      # tributary.engine.wire
    body.messages, body.max_completion_tokens, body.temperature

The Structs are the single list of fields these endpoints read: protocol.py converts a body
through them and applies OpenAI's and SGLang's rules (in their order and words),
`/openapi.json` publishes their JSON Schema (app/openapi.py), and tests/app/test_wire_fields.py
holds docs/api.md to them. Unknown keys are ignored, as SGLang and vLLM do.

The sampling keys (`SAMPLING_KEYS`) go to `SamplingParams.from_dict` under SGLang's names,
which checks them in SGLang's words; their types here are SamplingParamsBody's (the field
test compares them). Keys this server cannot honour are declared `Any` and refused when set.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

from ..generation import MAX_RID_LENGTH

__all__ = ["SAMPLING_KEYS", "SCHEMAS", "ChatBody", "CompletionBody", "OpenAIBody"]

#: The most alternatives per position (`logprobs`, `top_logprobs`): OpenAI's bound.
MAX_TOP_LOGPROBS = 20

_REF = "#/components/schemas/{}"
_UNSUPPORTED = "Not supported by this server yet: a 400 when set."


def _doc(description: str, **schema: Any) -> Meta:
    return Meta(description=description, extra_json_schema=schema or None)


def _sglang(name: str | None = None) -> Meta:
    return _doc(f"SGLang's sampling parameter {name}." if name else "As SGLang's SamplingParams.")


# Constraints msgspec checks too: a body that breaks one leaves the fast path, and
# protocol.py words the 400, as for a field of the wrong type.
_Count = Annotated[int, Meta(ge=0)]
_Top = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]


class OpenAIBody(msgspec.Struct, kw_only=True):
    """What both endpoints take."""

    lora_path: Annotated[Any, _doc(_UNSUPPORTED)] = None
    model: Annotated[str | None, _doc("The served model's name; may be left out.")] = None
    # Absent and null differ on /v1/completions: 16, or until the context is full.
    max_tokens: Annotated[
        _Count | UnsetType | None,
        _doc("Completion budget (completions: 16; chat: until the context is full)."),
    ] = UNSET
    n: Annotated[Annotated[int, Meta(ge=1)] | None, _doc("Choices per prompt.")] = None
    temperature: Annotated[float | None, _sglang()] = None
    top_p: Annotated[float | None, _sglang()] = None
    top_k: Annotated[int | None, _sglang()] = None
    min_p: Annotated[float | None, _sglang()] = None
    presence_penalty: Annotated[float | None, _sglang()] = None
    frequency_penalty: Annotated[float | None, _sglang()] = None
    repetition_penalty: Annotated[float | None, _sglang()] = None
    stop: Annotated[str | list[str] | None, _sglang()] = None
    stop_token_ids: Annotated[list[int | None] | None, _sglang()] = None
    ignore_eos: Annotated[bool | None, _sglang()] = None
    skip_special_tokens: Annotated[bool | None, _sglang()] = None
    spaces_between_special_tokens: Annotated[bool | None, _sglang()] = None
    no_stop_trim: Annotated[bool | None, _sglang()] = None
    logit_bias: Annotated[dict[str, float] | None, _sglang()] = None
    seed: Annotated[int | None, _sglang("sampling_seed")] = None
    min_tokens: Annotated[int | None, _sglang("min_new_tokens")] = None
    regex: Annotated[str | None, _sglang()] = None
    json_schema: Annotated[str | None, _sglang()] = None
    ebnf: Annotated[str | None, _sglang()] = None
    structural_tag: Annotated[str | None, _doc(_UNSUPPORTED)] = None
    stop_regex: Annotated[str | list[str] | None, _sglang()] = None
    custom_params: Annotated[dict[str, Any] | None, _sglang()] = None
    speculative_num_draft_tokens: Annotated[
        int | None,
        _doc(
            "Tributary's own: at most this many n-gram drafts a step (at most the "
            "server's --speculative-num-draft-tokens); 0 turns speculation off."
        ),
    ] = None
    response_format: Annotated[
        Any,
        _doc(
            "{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': {'name', "
            "'schema', 'strict'}}: the output follows the schema.",
            type="object",
            required=["type"],
            examples=[{"type": "json_object"}],
        ),
    ] = None
    stream: Annotated[bool | None, _doc("Answer with server-sent events.")] = None
    stream_options: Annotated[
        Any,
        _doc(
            "Only with stream.",
            type="object",
            properties={"include_usage": {"type": ["boolean", "null"]}},
        ),
    ] = None
    rid: Annotated[
        Annotated[str, Meta(max_length=MAX_RID_LENGTH)] | None,
        _doc("SGLang's request id; the response id."),
    ] = None
    custom_logit_processor: Annotated[
        str | None, _doc("A serialized SGLang processor (--enable-custom-logit-processor).")
    ] = None
    user: Annotated[str | None, _doc("Accepted and ignored.")] = None


class CompletionBody(OpenAIBody, kw_only=True):
    suffix: Annotated[Any, _doc(_UNSUPPORTED)] = None
    best_of: Annotated[Any, _doc("Not supported by this server yet, unless equal to n.")] = None
    echo: Annotated[bool | None, _doc("Each choice's text starts with its prompt.")] = None
    logprobs: Annotated[_Top | None, _doc("Alternatives per token.")] = None
    prompt: Annotated[
        Any,
        _doc(
            "A string, a list of strings, a token list, or a list of token lists.",
            anyOf=[
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                {"type": "array", "items": {"type": "integer"}, "minItems": 1},
                {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
                    "minItems": 1,
                },
            ],
        ),
    ] = None


_FUNCTION = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "description": {"type": "string"},
        "parameters": {"type": "object"},
        "strict": {"type": "boolean"},
    },
    "required": ["name"],
}


class ChatBody(OpenAIBody, kw_only=True):
    tools: Annotated[
        Any,
        _doc(
            "Functions the model may call: [{'type': 'function', 'function': {'name', "
            "'description', 'parameters' (a JSON Schema), 'strict'}}].",
            type="array",
            items={
                "type": "object",
                "properties": {"type": {"enum": ["function"]}, "function": _FUNCTION},
                "required": ["function"],
            },
            examples=[[{"type": "function", "function": {"name": "get_weather"}}]],
        ),
    ] = None
    functions: Annotated[Any, _doc(_UNSUPPORTED)] = None
    tool_choice: Annotated[
        Any,
        _doc(
            "'none', 'auto' (the default with tools), 'required', or {'type': 'function', "
            "'function': {'name'}}: required and a named function constrain the output to calls.",
            anyOf=[
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "properties": {
                        "type": {"enum": ["function"]},
                        "function": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}},
                            "required": ["name"],
                        },
                    },
                    "required": ["function"],
                },
                {"type": "null"},
            ],
        ),
    ] = None
    parallel_tool_calls: Annotated[bool | None, _doc("False: at most one call (default true).")] = (
        None
    )
    chat_template_kwargs: Annotated[
        dict[str, Any] | None, _doc("Passed to the chat template, e.g. {'enable_thinking': false}.")
    ] = None
    reasoning_effort: Annotated[
        str | float | None,
        _doc(
            "SGLang's: 'none', 'minimal', 'low', 'medium', 'high', 'xhigh', 'max' or a number in "
            "[0, 0.99]; passed to the template, and 'none' turns thinking off.",
            examples=["low"],
        ),
    ] = None
    separate_reasoning: Annotated[
        bool | None,
        _doc("With --reasoning-parser: split thinking into reasoning_content (default true)."),
    ] = None
    function_call: Annotated[Any, _doc(_UNSUPPORTED + " Null, 'none' and 'auto' are none.")] = None
    audio: Annotated[Any, _doc(_UNSUPPORTED)] = None
    modalities: Annotated[Any, _doc(_UNSUPPORTED + " ['text'] is none.")] = None
    prediction: Annotated[Any, _doc(_UNSUPPORTED)] = None
    messages: Annotated[
        Any,
        _doc(
            "The chat, at least one message.",
            type="array",
            items={"$ref": _REF.format("ChatMessage")},
            minItems=1,
        ),
    ] = None
    max_completion_tokens: Annotated[_Count | None, _doc("Wins over max_tokens.")] = None
    logprobs: Annotated[bool | None, _doc("Return the output's logprobs.")] = None
    top_logprobs: Annotated[_Top | None, _doc("Only with logprobs.")] = None


#: OpenAI key -> SamplingParams key, for every key passed straight through.
SAMPLING_KEYS = {
    name: {"seed": "sampling_seed", "min_tokens": "min_new_tokens"}.get(name, name)
    for name in OpenAIBody.__struct_fields__
    if name
    not in (
        "lora_path",
        "model",
        "max_tokens",
        "n",
        "response_format",
        "stream",
        "stream_options",
        "rid",
        "custom_logit_processor",
        "user",
    )
}

#: Both request bodies, for /openapi.json, by component name.
SCHEMAS: dict[str, type[msgspec.Struct]] = {
    "CompletionRequest": CompletionBody,
    "ChatCompletionRequest": ChatBody,
}
