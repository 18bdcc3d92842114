"""The native API's request bodies, declared once: `/generate`, `/tokenize`, `/detokenize`,
`/abort_request`.

Synopsis::

    body = convert(raw, GenerateBody, fault=...)     # tributary.engine.wire
    body.text, body.input_ids, body.sampling_params

Each Struct is the single list of a body's fields: `normalize.py` and `tokenize.py` convert a
body through it, `/openapi.json` publishes its JSON Schema (app/openapi.py), and
tests/app/test_wire_fields.py holds docs/api.md's field tables to it. Unknown top-level keys
are ignored, as SGLang does. Types say what the server accepts; ranges are stated for the
reader (`extra_json_schema`) and checked by the semantic layer in SGLang's order and words.
`sampling_params`' own fields are `engine.sampling.SamplingParamsBody`.

Fields that SGLang knows and this server does not implement are declared too (`Any`): a
request that sets one is refused with a 400 naming it, never served without it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from tributary.engine.sampling import SamplingParamsBody

from ..generation import MAX_RID_LENGTH

__all__ = [
    "MAX_TOKEN_IDS_LOGPROB",
    "SCHEMAS",
    "AbortBody",
    "DetokenizeBody",
    "GenerateBody",
    "TokenizeBody",
]

#: The most ids in `token_ids_logprob` (SGLang has no bound): each generated position gets
#: one entry per id.
MAX_TOKEN_IDS_LOGPROB = 128

_REF = "#/components/schemas/{}"


def _doc(description: str, **schema: Any) -> Meta:
    return Meta(description=description, extra_json_schema=schema or None)


def _per_prompt(kind: dict[str, Any]) -> dict[str, Any]:
    """A value for every prompt, or for a batch a list with one per prompt; null: default."""
    return {"anyOf": [kind, {"type": "array", "items": {"anyOf": [kind, {"type": "null"}]}}]}


# Constraints msgspec checks too: a body that breaks one leaves the fast path, and the
# semantic layer words the 400 (normalize.py), as for a field of the wrong type.
_Id = Annotated[int, Meta(ge=0)]
_Rid = Annotated[str, Meta(max_length=MAX_RID_LENGTH)]
_NONEMPTY = Meta(min_length=1)
_LOGPROB_IDS = Meta(max_length=MAX_TOKEN_IDS_LOGPROB)
_UNSUPPORTED = "Not supported by this server yet: a 400 when set."


class GenerateBody(msgspec.Struct, kw_only=True):
    """SGLang's GenerateReqInput: a prompt (`text` or `input_ids`), its sampling and output
    options. Fields are in the order the server checks them."""

    text: Annotated[
        str | list[str] | None, _doc("The prompt; a list makes a batch (even of one).")
    ] = None
    input_ids: Annotated[
        Annotated[list[_Id | Annotated[list[_Id], _NONEMPTY]], _NONEMPTY] | None,
        _doc("The prompt as token ids in [0, vocab); a list of lists makes a batch."),
    ] = None
    input_embeds: Annotated[Any, _doc(_UNSUPPORTED)] = None
    image_data: Annotated[Any, _doc(_UNSUPPORTED)] = None
    video_data: Annotated[Any, _doc(_UNSUPPORTED)] = None
    audio_data: Annotated[Any, _doc(_UNSUPPORTED)] = None
    return_hidden_states: Annotated[Any, _doc(_UNSUPPORTED + " False is none.")] = None
    lora_path: Annotated[Any, _doc(_UNSUPPORTED + " Null entries are none.")] = None
    session_params: Annotated[Any, _doc(_UNSUPPORTED)] = None
    stream: Annotated[bool | None, _doc("Answer with server-sent events.")] = None
    # Converted entry by entry by SamplingParams.from_dict (SGLang's words for each key).
    sampling_params: Annotated[
        Any,
        _doc(
            "An object, or for a batch a list with one object per prompt; null means {}.",
            anyOf=[
                {"$ref": _REF.format("SamplingParams")},
                {"type": "array", "items": {"$ref": _REF.format("SamplingParams")}},
                {"type": "null"},
            ],
        ),
    ] = None
    rid: Annotated[
        _Rid | list[_Rid] | None,
        _doc(
            "Request id; for a batch, a str is every item's prefix (rid_i), a list has one "
            "per prompt."
        ),
    ] = None
    return_logprob: Annotated[
        bool | list[bool | None] | None,
        _doc("Add logprobs to meta_info.", **_per_prompt({"type": "boolean"})),
    ] = None
    logprob_start_len: Annotated[
        int | list[int | None] | None,
        _doc("-1: output only; k: prompt positions k and on.", **_per_prompt({"type": "integer"})),
    ] = None
    top_logprobs_num: Annotated[
        int | list[int | None] | None,
        _doc(
            "At most the server's --max-logprobs (20 by default).",
            **_per_prompt({"type": "integer", "minimum": 0}),
        ),
    ] = None
    token_ids_logprob: Annotated[
        Annotated[list[_Id | Annotated[list[_Id], _LOGPROB_IDS] | None], _LOGPROB_IDS] | None,
        _doc(
            f"Ids in [0, vocab), at most {MAX_TOKEN_IDS_LOGPROB}, none twice; a batch may "
            "give a list per prompt."
        ),
    ] = None
    custom_logit_processor: Annotated[
        str | list[str | None] | None,
        _doc(
            "A serialized SGLang processor (--enable-custom-logit-processor).",
            **_per_prompt({"type": "string"}),
        ),
    ] = None
    return_text_in_logprobs: Annotated[
        bool | None, _doc("Fill the text slot of each logprob entry.")
    ] = None


_CHAT_OPTION = "Not supported by this server yet: a 400 when set (with messages)."


class TokenizeBody(msgspec.Struct, kw_only=True):
    """Exactly one of `prompt` and `messages`."""

    prompt: Annotated[
        Any,
        _doc(
            "Text to tokenize; a list gives one token list per string.",
            anyOf=[{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
        ),
    ] = None
    messages: Annotated[
        Any,
        _doc(
            "Chat messages, rendered as /v1/chat/completions renders them.",
            type="array",
            items={"$ref": _REF.format("ChatMessage")},
        ),
    ] = None
    add_special_tokens: Annotated[bool | None, _doc("With prompt; default true.")] = None
    add_generation_prompt: Annotated[bool | None, _doc("With messages; default true.")] = None
    model: Annotated[str | None, _doc("Accepted and ignored.")] = None
    tools: Annotated[Any, _doc(_CHAT_OPTION)] = None
    tool_choice: Annotated[Any, _doc(_CHAT_OPTION + " Null, 'none' and 'auto' are none.")] = None
    reasoning_effort: Annotated[Any, _doc(_CHAT_OPTION)] = None
    continue_final_message: Annotated[Any, _doc(_CHAT_OPTION + " False is none.")] = None
    chat_template_kwargs: Annotated[Any, _doc(_CHAT_OPTION)] = None


class DetokenizeBody(msgspec.Struct, kw_only=True):
    tokens: Annotated[
        Any,
        _doc(
            "Token ids in [0, vocab), or a list of such lists.",
            anyOf=[
                {"type": "array", "items": {"type": "integer", "minimum": 0}},
                {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                },
            ],
        ),
    ] = None
    skip_special_tokens: Annotated[bool | None, _doc("Default true.")] = None
    model: Annotated[str | None, _doc("Accepted and ignored.")] = None


class AbortBody(msgspec.Struct, kw_only=True):
    rid: Annotated[
        str | None, _doc("Aborts this rid and the items a batch fanned out from it.")
    ] = None
    abort_all: Annotated[bool, _doc("Abort every request.")] = False


#: Every request body of the native API, for /openapi.json, by component name.
SCHEMAS: dict[str, type[msgspec.Struct]] = {
    "SamplingParams": SamplingParamsBody,
    "GenerateRequest": GenerateBody,
    "TokenizeRequest": TokenizeBody,
    "DetokenizeRequest": DetokenizeBody,
    "AbortRequest": AbortBody,
}
