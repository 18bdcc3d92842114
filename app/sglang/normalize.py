"""SGLang's `GenerateReqInput` normalization: one JSON body in, a flat list of engine requests out.

Synopsis::

    req = normalize_generate(body, vocab_size=eng.model_info.vocab_size)
    req.items       # list[GenerateRequest], prompt-major: [p0s0, p0s1, ..., p1s0, ...]
    req.is_batch    # answer with a JSON array / tag stream frames with `index`
    req.stream

Rules (docs/api.md, contract section 1):

- a prompt is `text` (str, or list[str] for a batch) or `input_ids` (list[int], or
  list[list[int]]); at least one is required; when both are given the shape comes from `text`
  and the tokens from `input_ids`, as SGLang does;
- `sampling_params` is an object (shared) or, for a batch, a list with one object per prompt;
- `n > 1` turns each prompt into n samples (a single prompt becomes a batch) and gives every
  sample a fresh uuid rid;
- `rid`: a str is used as-is for a single request and fans out as `rid_i` for a batch; a list
  must have one str per prompt; duplicates inside one request are rejected; each at most
  MAX_RID_LENGTH characters (it is echoed in every frame and access log line);
- logprobs: `return_logprob`, `logprob_start_len`, `top_logprobs_num`, `token_ids_logprob`
  (each a value for every prompt, or for a batch a list with one per prompt; null means the
  default) and `return_text_in_logprobs`; without `return_logprob` the others are ignored, as
  in SGLang; `top_logprobs_num` is at most the server's `max_logprobs` and
  `token_ids_logprob` holds at most MAX_TOKEN_IDS_LOGPROB ids, none twice (each position's
  entries are what a response and the engine's memory grow by);
- `custom_logit_processor`: a serialized processor, or for a batch a list (null entries for
  prompts without one);
- unknown top-level keys are ignored; features this server does not implement yet
  (multimodal inputs, LoRA, ...) are rejected rather than silently dropped.

The fields are declared once, in `protocol.GenerateBody` (and `sampling_params`' in
`engine.SamplingParamsBody`); the body is converted through it in one call. What remains here
is SGLang's semantics, in SGLang's order: the shape of a batch, scalar-or-list per prompt,
null meaning the default, rids, and the words of every refusal. A field not of its declared
type is worded by `_words` and raised where these rules read it (`Pending.raise_for`), so that
a body with several faults reports the first they meet. `input_ids` and `token_ids_logprob`
are checked here whatever their declaration says (their rules accept ids the declaration's
bounds do not, and refuse shapes it cannot state: a list mixing ids and lists).

Every failure raises `engine.BadRequest` (or its `InvalidSamplingParams` subclass) with
SGLang's message where SGLang has one; nothing is submitted.
"""

from __future__ import annotations

import collections
import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from tributary.engine import BadRequest, GenerateRequest, LogprobRequest, SamplingParams
from tributary.engine.token_ids import EMPTY_INPUT_IDS, check_token_ids
from tributary.engine.wire import Pending, convert_pending

from ..generation import check_fan_out, check_rid, seeded_sample
from ..settings import ServerSettings
from .protocol import MAX_TOKEN_IDS_LOGPROB, GenerateBody

__all__ = [
    "MAX_TOKEN_IDS_LOGPROB",
    "NormalizedGenerate",
    "normalize_generate",
]


@dataclasses.dataclass(frozen=True)
class NormalizedGenerate:
    items: list[GenerateRequest]
    is_batch: bool
    stream: bool
    #: `return_text_in_logprobs`: fill the text slot of every logprob entry.
    text_in_logprobs: bool = False


def _truthy(value: Any) -> bool:
    if isinstance(value, list):
        return any(_truthy(v) for v in value)
    return bool(value)


# Fields SGLang knows that change what a client gets back; accepting them silently would
# answer a different question than the one asked. Each maps to "is it in use?"
# (GenerateBody declares them; tests/app/test_wire_fields.py sees each one refused).
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "input_embeds": lambda v: v is not None,
    "image_data": lambda v: v is not None,
    "video_data": lambda v: v is not None,
    "audio_data": lambda v: v is not None,
    "return_hidden_states": _truthy,
    "lora_path": _truthy,
    "session_params": lambda v: v is not None,
}

_NO_PROMPT = "Either text, input_ids or input_embeds should be provided."


_BOOLEAN, _INTEGER, _STRING = (bool, "a boolean"), (int, "an integer"), (str, "a string")
#: The fields worded by their JSON type: key -> (the type, its name).
_KINDS = {
    "stream": _BOOLEAN,
    "return_logprob": _BOOLEAN,
    "logprob_start_len": _INTEGER,
    "top_logprobs_num": _INTEGER,
    "custom_logit_processor": _STRING,
    "return_text_in_logprobs": _BOOLEAN,
}
#: Those that take a value for every prompt, or for a batch a list with one per prompt.
_PER_PROMPT = ("return_logprob", "logprob_start_len", "top_logprobs_num", "custom_logit_processor")
_RID_TYPE = str | list[str]
_RID_FAULT = "The rid should be a string or a list of strings."


def _words(key: str, value: Any) -> BadRequest | None:
    """The 400 for a field that did not convert (a per-prompt list: its first wrong entry);
    None for a value of the field's type out of its declared bounds (an id below 0, a rid
    too long, an integer too large for msgspec), which the rules word."""
    if key == "text":
        return BadRequest(f"text must be a string or a list of strings, got {value!r}.")
    if key == "rid":
        try:
            msgspec.convert(value, _RID_TYPE)
        except msgspec.ValidationError:
            return BadRequest(_RID_FAULT)
        return None  # too long: check_rid words it
    kind = _KINDS.get(key)
    if kind is None:
        return None  # input_ids, token_ids_logprob: their rules word them
    values = value if key in _PER_PROMPT and isinstance(value, list) else [value]
    for v in values:
        if v is not None and not _is_kind(v, kind[0]):
            return _type_error(key, v)
    return None


def _is_kind(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _type_error(key: str, value: Any) -> BadRequest:
    return BadRequest(f"{key} must be {_KINDS[key][1]}, got {value!r}.")


def normalize_generate(
    raw: Any,
    *,
    vocab_size: int,
    max_items: int | None = None,
    max_logprobs: int = ServerSettings.max_logprobs,
) -> NormalizedGenerate:
    if not isinstance(raw, dict):
        raise BadRequest("The request body must be a JSON object.")
    body, pending = convert_pending(raw, GenerateBody, _words)
    text, input_ids = body.text, body.input_ids
    if text is None and input_ids is None and body.input_embeds is None:
        raise BadRequest(_NO_PROMPT)
    for field, in_use in _UNSUPPORTED.items():
        value = getattr(body, field)
        if value is not None and in_use(value):
            raise BadRequest(f"{field} is not supported by this server yet.")
    pending.raise_for("stream")
    stream = bool(body.stream)

    texts, ids, batch_size = _prompts(pending, text, input_ids)
    is_batch = batch_size is not None
    size = batch_size if batch_size is not None else 1
    params = _sampling(body.sampling_params, size, is_batch, vocab_size)
    n = params[0].n
    if any(p.n != n for p in params):
        raise BadRequest(
            "The parallel_sample_num should be the same for all samples in sample params."
        )
    if n > 1:
        is_batch = True
    check_fan_out(size * n, max_items)
    rids = _rids(pending, body.rid, size, n, is_batch)
    logprobs = _logprob_requests(body, pending, size, n, is_batch, vocab_size, max_logprobs)
    processors = [
        p or None
        for p in _per_prompt(body, pending, "custom_logit_processor", size, n, is_batch, None)
    ]
    pending.raise_for("return_text_in_logprobs")
    text_in_logprobs = bool(body.return_text_in_logprobs)

    items = []
    for p in range(size):
        sampling = params[p] if params[p].n == 1 else dataclasses.replace(params[p], n=1)
        for s in range(n):
            items.append(
                GenerateRequest(
                    text=texts[p] if texts is not None else None,
                    input_ids=ids[p] if ids is not None else None,
                    sampling=seeded_sample(sampling, s),
                    rid=rids[p * n + s],
                    logprobs=logprobs[p],
                    custom_logit_processor=processors[p],
                    stream=stream,
                )
            )
    return NormalizedGenerate(
        items=items, is_batch=is_batch, stream=stream, text_in_logprobs=text_in_logprobs
    )


def _per_prompt(
    body: GenerateBody,
    pending: Pending,
    key: str,
    size: int,
    n: int,
    is_batch: bool,
    default: Any,
    convert: Callable[[str, Any], Any] | None = None,
    *,
    is_list_form: Callable[[Any], bool] = lambda v: isinstance(v, list),
) -> list[Any]:
    """One value per prompt: a scalar applies to every prompt; for a batch, a list gives one
    per prompt (SGLang's S/B fields). Null means `default`. Without `convert`, the values
    are the declared ones (their type faults raised here); `convert` words its own."""
    value = getattr(body, key)
    if value is None:
        return [default] * size
    if is_batch and is_list_form(value):
        if n > 1:
            raise BadRequest(f"Cannot use list {key} with parallel_sample_num > 1")
        if len(value) != size:
            raise BadRequest(f"The length of {key} should be equal to the batch size.")
        if convert is not None:
            return [default if v is None else convert(key, v) for v in value]
        pending.raise_for(key)
        return [default if v is None else v for v in value]
    if convert is not None:
        return [convert(key, value)] * size
    if isinstance(value, list):  # a list where one value for every prompt is due
        raise _type_error(key, value)
    pending.raise_for(key)
    return [value] * size


def _token_ids(key: str, value: Any, vocab_size: int) -> tuple[int, ...] | None:
    def as_id(x: Any) -> int:
        if isinstance(x, float) and x.is_integer():
            return int(x)  # `2e9` from a Python client: an id, just not a valid one
        if isinstance(x, int) and not isinstance(x, bool):
            return x
        raise BadRequest("token_ids_logprob must be a flat list of integers.")

    if not isinstance(value, list):
        raise BadRequest("token_ids_logprob must be a flat list of integers.")
    if len(value) > MAX_TOKEN_IDS_LOGPROB:
        raise BadRequest(
            f"token_ids_logprob holds {len(value)} ids, more than the "
            f"{MAX_TOKEN_IDS_LOGPROB} allowed."
        )
    ids = tuple(as_id(x) for x in value)
    if len(set(ids)) != len(ids):
        # Refused, not deduplicated: each entry answers the id at the same place in the
        # request (SGLang's order), so dropping one would shift every later answer.
        dup = next(t for t, count in collections.Counter(ids).items() if count > 1)
        raise BadRequest(f"token_ids_logprob lists token id {dup} more than once.")
    check_token_ids("token_ids_logprob", ids, vocab_size)
    return ids or None  # SGLang: an empty list means none


def _logprob_requests(
    body: GenerateBody,
    pending: Pending,
    size: int,
    n: int,
    is_batch: bool,
    vocab_size: int,
    max_logprobs: int,
) -> list[LogprobRequest | None]:
    """Each prompt's LogprobRequest, or None where `return_logprob` is off."""
    if (
        body.return_logprob is None
        and body.logprob_start_len is None
        and body.top_logprobs_num is None
        and body.token_ids_logprob is None
    ):
        return [None] * size  # the common case: nothing asked, nothing to check
    wanted = _per_prompt(body, pending, "return_logprob", size, n, is_batch, False)
    starts = _per_prompt(body, pending, "logprob_start_len", size, n, is_batch, -1)
    tops = _per_prompt(body, pending, "top_logprobs_num", size, n, is_batch, 0)
    # A single request's ids are a flat list; a batch's, a list of lists (or one flat list
    # for every prompt).
    ids = _per_prompt(
        body,
        pending,
        "token_ids_logprob",
        size,
        n,
        is_batch,
        None,
        lambda key, value: _token_ids(key, value, vocab_size),
        is_list_form=lambda v: isinstance(v, list) and bool(v) and isinstance(v[0], list | None),
    )
    for p in range(size):
        if wanted[p] and tops[p] > max_logprobs:
            raise BadRequest(
                f"top_logprobs_num is {tops[p]}, more than the {max_logprobs} this server "
                "allows (--max-logprobs)."
            )
    return [
        LogprobRequest(start_len=starts[p], top_n=tops[p], token_ids=ids[p]) if wanted[p] else None
        for p in range(size)
    ]


def _prompts(
    pending: Pending, text: str | list[str] | None, input_ids: Any
) -> tuple[list[str] | None, list[list[int]] | None, int | None]:
    """(texts, ids, batch_size); batch_size is None for a single request."""
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    batch_size: int | None = None
    if text is not None:
        pending.raise_for("text")
        if isinstance(text, str):
            texts = [text]
        else:
            texts, batch_size = text, len(text)
    if input_ids is not None:
        if not isinstance(input_ids, list):
            raise BadRequest(
                f"input_ids must be a list of token ids or a list of lists, got {input_ids!r}."
            )
        if not input_ids:
            raise BadRequest(EMPTY_INPUT_IDS)
        if _is_ids(input_ids):
            ids_single = True
            ids = [input_ids]
        elif all(isinstance(x, list) and _is_ids(x) for x in input_ids):
            ids_single = False
            ids = input_ids
        else:
            raise BadRequest(
                "input_ids must be a list of integers, or a list of lists of integers for "
                "batch processing."
            )
        if texts is None:
            batch_size = None if ids_single else len(ids)
        elif len(ids) != len(texts):
            raise BadRequest("text and input_ids must describe the same number of prompts.")
    if batch_size == 0:
        raise BadRequest("The batch is empty: text or input_ids must name at least one prompt.")
    return texts, ids, batch_size


def _is_ids(values: list[Any]) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in values)


def _sampling(raw: Any, size: int, is_batch: bool, vocab_size: int) -> list[SamplingParams]:
    """One verified SamplingParams per prompt."""
    if raw is None or isinstance(raw, dict):
        params = SamplingParams.from_dict(raw)
        params.verify(vocab_size)
        return [params] * size
    if not isinstance(raw, list) or not is_batch:
        raise BadRequest(
            "sampling_params must be an object, or for a batch a list with one object per prompt."
        )
    if len(raw) != size:
        raise BadRequest("The length of sampling_params should be equal to the batch size.")
    out = []
    for entry in raw:
        params = SamplingParams.from_dict(entry)
        params.verify(vocab_size)
        out.append(params)
    return out


def _rids(
    pending: Pending, rid: str | list[str] | None, size: int, n: int, is_batch: bool
) -> list[str | None]:
    """One rid (or None: the engine makes one) per expanded item."""
    num = size * n
    if not is_batch:
        pending.raise_for("rid")
        if isinstance(rid, list):  # one rid for one request
            raise BadRequest(_RID_FAULT)
        check_rid(rid)
        return [rid]
    if isinstance(rid, list):
        if len(rid) != size:
            raise BadRequest(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        pending.raise_for("rid")
        for r in rid:
            check_rid(r)
    else:
        pending.raise_for("rid")
        check_rid(rid)
    if n > 1:
        # SGLang regenerates every sample's rid, so client rids are not echoed with n > 1.
        return [uuid.uuid4().hex for _ in range(num)]
    if rid is None:
        return [None] * num
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(num)]
    dups = sorted(r for r, count in collections.Counter(rid).items() if count > 1)
    if dups:
        raise BadRequest(f"Duplicate request IDs detected within the request: {dups}")
    return list(rid)
