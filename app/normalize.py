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

Every failure raises `engine.BadRequest` (or its `InvalidSamplingParams` subclass) with
SGLang's message where SGLang has one; nothing is submitted.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from quart import request
from werkzeug.exceptions import RequestEntityTooLarge

from tributary.engine import BadRequest, GenerateRequest, LogprobRequest, SamplingParams

from .limits import TIMEOUT_HEADER, Deadline, RequestTooLarge
from .settings import ServerSettings

__all__ = [
    "MAX_RID_LENGTH",
    "MAX_TOKEN_IDS_LOGPROB",
    "NormalizedGenerate",
    "bool_field",
    "check_rid",
    "normalize_generate",
    "read_json_body",
]

#: The longest client rid, in characters. A rid is echoed in every stream frame, every
#: batch item (a str rid is every item's prefix) and every access log line, so an unbounded
#: one multiplies a request's size. SGLang and vLLM have no bound; 256 holds any uuid,
#: trace id or composite key.
MAX_RID_LENGTH = 256
#: The most ids in `token_ids_logprob` (SGLang has no bound): each generated position gets
#: one entry per id.
MAX_TOKEN_IDS_LOGPROB = 128


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
# answer a different question than the one asked. Each maps to "is it in use?".
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


async def read_within_deadline(settings: ServerSettings) -> tuple[Any, Deadline]:
    """The current request's deadline (the server's `--request-timeout` and the request's
    `X-Request-Timeout` header) and its JSON body, read within that deadline."""
    deadline = Deadline.for_request(settings, request.headers.get(TIMEOUT_HEADER))
    with deadline.applied():
        body = await read_json_body()
    return body, deadline


async def read_json_body() -> Any:
    """The current request's body as JSON; anything that is not usable JSON is a
    `BadRequest` (400), never a 500 later on; a body past the size limit, `RequestTooLarge`
    (413), raised as soon as it passes the limit."""
    try:
        data = await request.get_data(as_text=False)
    except RequestEntityTooLarge:
        raise RequestTooLarge(request.max_content_length) from None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        # ValueError covers malformed JSON, bad UTF-8 and integers over Python's 4,300-digit
        # limit; RecursionError, nesting deeper than the parser's stack.
        reason = "it is nested too deeply" if isinstance(exc, RecursionError) else exc
        raise BadRequest(f"Invalid JSON in the request body: {reason}") from None
    # JSON may spell unpaired UTF-16 surrogates ("\\ud800"), which are not Unicode: they
    # would fail much later, when the response is encoded (a 500, or a cut stream). orjson
    # refuses them fast; what else it refuses (integers beyond 64 bits) is checked slowly.
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise BadRequest(
                "Invalid JSON in the request body: a string holds an unpaired UTF-16 surrogate."
            ) from None
    return body


def check_fan_out(count: int, max_items: int | None) -> None:
    """A request that expands to more items than the engine takes at once can never be
    admitted: a 400 that says so, not a "retry later" 503 it would retry for ever. Checked
    before expanding, so a huge `n` costs nothing."""
    if max_items is not None and count > max_items:
        raise BadRequest(
            f"The request expands to {count} generations (prompts x n), more than this server "
            f"takes at once ({max_items}: --max-running-requests + --max-queued-requests); "
            "split it into smaller ones."
        )


def seeded_sample(sampling: SamplingParams, index: int) -> SamplingParams:
    """The params of sample `index` of n: with a seed, each sample gets seed + index (as
    vLLM does), so n samples are n different draws and the whole response is reproducible."""
    if sampling.sampling_seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, sampling_seed=sampling.sampling_seed + index)


def normalize_generate(
    body: Any,
    *,
    vocab_size: int,
    max_items: int | None = None,
    max_logprobs: int = ServerSettings.max_logprobs,
) -> NormalizedGenerate:
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None and body.get("input_embeds") is None:
        raise BadRequest(_NO_PROMPT)
    for field, in_use in _UNSUPPORTED.items():
        if in_use(body.get(field)):
            raise BadRequest(f"{field} is not supported by this server yet.")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be a boolean, got {stream!r}.")

    texts, ids, batch_size = _prompts(text, input_ids)
    is_batch = batch_size is not None
    size = batch_size if batch_size is not None else 1
    params = _sampling(body.get("sampling_params"), size, is_batch, vocab_size)
    n = params[0].n
    if any(p.n != n for p in params):
        raise BadRequest(
            "The parallel_sample_num should be the same for all samples in sample params."
        )
    if n > 1:
        is_batch = True
    check_fan_out(size * n, max_items)
    rids = _rids(body.get("rid"), size, n, is_batch)
    logprobs = _logprob_requests(body, size, n, is_batch, vocab_size, max_logprobs)
    processors = _per_prompt(body, "custom_logit_processor", size, n, is_batch, _optional_str, None)
    text_in_logprobs = bool_field(body, "return_text_in_logprobs")

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


def bool_field(body: dict[str, Any], key: str, *, default: bool = False) -> bool:
    """An optional boolean of the body: null or absent means `default`."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be a boolean, got {value!r}.")
    return value


def _int_value(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer, got {value!r}.")
    return value


def _bool_value(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be a boolean, got {value!r}.")
    return value


def _optional_str(key: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{key} must be a string, got {value!r}.")
    return value or None


def _per_prompt(
    body: dict[str, Any],
    key: str,
    size: int,
    n: int,
    is_batch: bool,
    convert: Callable[[str, Any], Any],
    default: Any,
    *,
    is_list_form: Callable[[Any], bool] = lambda v: isinstance(v, list),
) -> list[Any]:
    """One value per prompt: a scalar applies to every prompt; for a batch, a list gives one
    per prompt (SGLang's S/B fields). Null means `default`."""
    value = body.get(key)
    if value is None:
        return [default] * size
    if is_batch and is_list_form(value):
        if n > 1:
            raise BadRequest(f"Cannot use list {key} with parallel_sample_num > 1")
        if len(value) != size:
            raise BadRequest(f"The length of {key} should be equal to the batch size.")
        return [default if v is None else convert(key, v) for v in value]
    return [convert(key, value)] * size


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
    for token in ids:
        if not 0 <= token < vocab_size:
            raise BadRequest(
                f"token_ids_logprob contains out-of-vocabulary token id {token}; "
                f"valid range is [0, {vocab_size})."
            )
    return ids or None  # SGLang: an empty list means none


def _logprob_requests(
    body: dict[str, Any], size: int, n: int, is_batch: bool, vocab_size: int, max_logprobs: int
) -> list[LogprobRequest | None]:
    """Each prompt's LogprobRequest, or None where `return_logprob` is off."""
    wanted = _per_prompt(body, "return_logprob", size, n, is_batch, _bool_value, False)
    starts = _per_prompt(body, "logprob_start_len", size, n, is_batch, _int_value, -1)
    tops = _per_prompt(body, "top_logprobs_num", size, n, is_batch, _int_value, 0)
    # A single request's ids are a flat list; a batch's, a list of lists (or one flat list
    # for every prompt).
    ids = _per_prompt(
        body,
        "token_ids_logprob",
        size,
        n,
        is_batch,
        lambda key, value: _token_ids(key, value, vocab_size),
        None,
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
    text: Any, input_ids: Any
) -> tuple[list[str] | None, list[list[int]] | None, int | None]:
    """(texts, ids, batch_size); batch_size is None for a single request."""
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    batch_size: int | None = None
    if text is not None:
        if isinstance(text, str):
            texts = [text]
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            texts, batch_size = text, len(text)
        else:
            raise BadRequest(f"text must be a string or a list of strings, got {text!r}.")
    if input_ids is not None:
        if not isinstance(input_ids, list):
            raise BadRequest(
                f"input_ids must be a list of token ids or a list of lists, got {input_ids!r}."
            )
        if not input_ids:
            raise BadRequest("input_ids cannot be empty.")
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


def check_rid(rid: str | None, *, field: str = "rid") -> None:
    """A client rid longer than MAX_RID_LENGTH characters is a 400 (the length, not the rid,
    goes in the message)."""
    if rid is not None and len(rid) > MAX_RID_LENGTH:
        raise BadRequest(
            f"{field} is {len(rid)} characters long, more than the {MAX_RID_LENGTH} allowed."
        )


def _rids(rid: Any, size: int, n: int, is_batch: bool) -> list[str | None]:
    """One rid (or None: the engine makes one) per expanded item."""
    num = size * n
    if not is_batch:
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("The rid should be a string or a list of strings.")
        check_rid(rid)
        return [rid]
    if isinstance(rid, list):
        if len(rid) != size:
            raise BadRequest(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        if not all(isinstance(r, str) for r in rid):
            raise BadRequest("The rid should be a string or a list of strings.")
        for r in rid:
            check_rid(r)
    elif rid is not None and not isinstance(rid, str):
        raise BadRequest("The rid should be a string or a list of strings.")
    else:
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
