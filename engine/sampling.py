"""SGLang's `SamplingParams`: fields, defaults, normalization and validation messages.

Synopsis::

    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 16})
    params.verify(vocab_size)        # raises InvalidSamplingParams with SGLang's wording

`SamplingParamsBody` declares the JSON form (field names, types, /openapi.json's schema);
`from_dict` converts through it and does what SGLang's `SamplingParams(**d)` + `__post_init__`
do (unknown keys are an error; an explicit null means the default, except `max_new_tokens`,
where null means unbounded), and `verify` does what `SamplingParams.verify(vocab_size)` does.
A params object remembers the vocabulary it was verified for: the app verifies once, and the
engine's own `verify` at submit returns at once (it still checks params nobody verified).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, NoReturn

import msgspec

# Not `import regex`: a SamplingParams field has that name.
import regex as regex_pkg  # type: ignore[import-untyped]
from msgspec import UNSET, Meta, UnsetType

from .errors import InvalidSamplingParams
from .grammar_bounds import stop_regex_problem
from .wire import convert

__all__ = [
    "GREEDY_TEMPERATURE",
    "MAX_STOP_CHARS",
    "MAX_STOP_COUNT",
    "MAX_STOP_REGEX_BYTES",
    "MAX_STOP_REGEX_COUNT",
    "MAX_STOP_TOKEN_IDS",
    "TOP_K_ALL",
    "SamplingParams",
]

#: SGLang's "all tokens" top_k; -1 in a request maps to it.
TOP_K_ALL = 1 << 30
#: Below this temperature SGLang samples greedily (rewritten to temperature 1.0, top_k 1).
GREEDY_TEMPERATURE = 1e-6
# Bounds on the stop lists, which are checked after every token on the event loop (SGLang,
# vLLM and llama-server have none; OpenAI takes at most 4 stop strings). Each pattern of
# stop_regex is searched after every token.
MAX_STOP_REGEX_COUNT = 32
MAX_STOP_REGEX_BYTES = 256
#: The most `stop` strings, and each one's length in characters: a token's stop check costs
#: about count x (length + the token's characters) comparisons (engine/detokenize.py).
MAX_STOP_COUNT = 64
MAX_STOP_CHARS = 256
#: The most entries in `stop_token_ids` (as sent, before duplicates are dropped).
MAX_STOP_TOKEN_IDS = 1024

# Keys SGLang knows but this engine cannot honour yet: a request setting one gets a clear 400
# instead of being silently served without it.
_UNSUPPORTED = ("structural_tag",)


def _field(description: str, **schema: Any) -> Meta:
    """A field's documentation in /openapi.json; `schema` states its range for the reader
    (SamplingParams.verify enforces it, in SGLang's words)."""
    return Meta(description=description, extra_json_schema=schema or None)


_STOPS_DOC = (
    f"At most {MAX_STOP_COUNT} strings, each at most {MAX_STOP_CHARS} characters; empty ones "
    "are dropped."
)


class SamplingParamsBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's SamplingParams; an unknown key is a 400, and null means the key's default
    (for max_new_tokens: no bound)."""

    max_new_tokens: Annotated[
        int | UnsetType | None, _field("Default 128; null: until the context is full.", minimum=0)
    ] = UNSET
    min_new_tokens: Annotated[int | None, _field("At most max_new_tokens.", minimum=0)] = None
    temperature: Annotated[
        float | None, _field("Below 1e-6 means greedy (top_k 1).", minimum=0)
    ] = None
    top_p: Annotated[float | None, _field("In (0, 1].", exclusiveMinimum=0, maximum=1)] = None
    top_k: Annotated[int | None, _field("-1 (all) or at least 1.")] = None
    min_p: Annotated[float | None, _field("In [0, 1].", minimum=0, maximum=1)] = None
    frequency_penalty: Annotated[float | None, _field("In [-2, 2].", minimum=-2, maximum=2)] = None
    presence_penalty: Annotated[float | None, _field("In [-2, 2].", minimum=-2, maximum=2)] = None
    repetition_penalty: Annotated[
        float | None, _field("In (0, 2]; 1 is no penalty.", exclusiveMinimum=0, maximum=2)
    ] = None
    stop: Annotated[str | list[str] | None, _field(_STOPS_DOC)] = None
    stop_token_ids: Annotated[
        list[int | None] | None,
        _field("Token ids in [0, vocab).", maxItems=MAX_STOP_TOKEN_IDS),
    ] = None
    stop_regex: Annotated[
        str | list[str] | None,
        _field(
            f"At most {MAX_STOP_REGEX_COUNT} patterns, each at most {MAX_STOP_REGEX_BYTES} "
            "bytes of UTF-8."
        ),
    ] = None
    ignore_eos: Annotated[bool | None, _field("Keep generating past EOS.")] = None
    skip_special_tokens: Annotated[bool | None, _field("Default true.")] = None
    spaces_between_special_tokens: Annotated[bool | None, _field("Default true.")] = None
    no_stop_trim: Annotated[bool | None, _field("Keep the matched stop string.")] = None
    n: Annotated[int | None, _field("Parallel samples.", minimum=1)] = None
    stream_interval: Annotated[int | None, _field("Tokens per frame.", minimum=1)] = None
    logit_bias: Annotated[
        dict[str, float] | None,
        _field(f"Token id -> bias; ids in [0, vocab), |bias| at most {MAX_LOGIT_BIAS:g}."),
    ] = None
    sampling_seed: Annotated[int | None, _field("Makes sampling repeatable.")] = None
    custom_params: Annotated[
        dict[str, Any] | None, _field("For the request's custom logit processor.")
    ] = None
    json_schema: Annotated[str | None, _field("The output follows this JSON Schema.")] = None
    regex: Annotated[str | None, _field("The output matches this regular expression.")] = None
    ebnf: Annotated[str | None, _field("The output matches this GBNF grammar.")] = None
    structural_tag: Annotated[
        str | None, _field("Not supported by this server yet: a 400 when set.")
    ] = None
    speculative_num_draft_tokens: Annotated[
        int | None,
        _field(
            "Speculative decoding: tokens drafted at most per step, up to the server's "
            "--speculative-num-draft-tokens; 0 turns it off for this request.",
            minimum=0,
        ),
    ] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    stream_interval: int | None = None
    logit_bias: Mapping[int, float] = dataclasses.field(default_factory=dict)
    sampling_seed: int | None = None
    custom_params: Mapping[str, Any] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    #: Normalized: a string becomes a 1-tuple; empty patterns are dropped (as for `stop`).
    stop_regex: tuple[str, ...] = ()
    #: Draft tokens per step at most (speculative decoding); None: the server's.
    speculative_num_draft_tokens: int | None = None

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @functools.cached_property
    def stop_regex_patterns(self) -> tuple[regex_pkg.Pattern, ...]:
        """`stop_regex` compiled, once per params object (not a field: equality and
        `dataclasses.replace` see only the pattern strings). Raises InvalidSamplingParams
        naming the first pattern that does not compile."""
        patterns = []
        for pattern in self.stop_regex:
            # Bounds first: `a{1000000000}` makes the compiler allocate until the process dies.
            if problem := stop_regex_problem(pattern):
                _fail(f"invalid stop_regex '{pattern}': {problem}")
            try:
                patterns.append(regex_pkg.compile(pattern))
            except regex_pkg.error as exc:
                _fail(f"invalid stop_regex '{pattern}': {exc}")
        return tuple(patterns)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any] | None) -> SamplingParams:
        """Build from a request's `sampling_params` object (None means `{}`).

        Raises InvalidSamplingParams for unknown keys and for values of the wrong type.
        """
        if obj is None:
            return cls()
        if not isinstance(obj, Mapping):
            raise InvalidSamplingParams("sampling_params must be an object")
        unknown = sorted(k for k in obj if k not in _FIELD_NAMES)
        if unknown:
            raise InvalidSamplingParams(
                f"unknown field `{unknown[0]}` in sampling_params, expected one of "
                + ", ".join(f"`{k}`" for k in sorted(_FIELD_NAMES))
            )
        raw = obj if isinstance(obj, dict) else dict(obj)
        body = convert(raw, SamplingParamsBody, fault=_fault, order="body", check=_check)
        kwargs = _normalize(body, obj)
        temperature = kwargs.get("temperature", 1.0)
        if 0 <= temperature < GREEDY_TEMPERATURE:
            kwargs["temperature"] = 1.0
            kwargs["top_k"] = 1
        if kwargs.get("top_k") == -1:
            kwargs["top_k"] = TOP_K_ALL
        return cls(**kwargs)

    def verify(self, vocab_size: int) -> None:
        """SGLang's checks, in SGLang's order, with its messages."""
        # The app verifies; the engine asks again at submit, and this answers at once. Kept
        # beside the cached patterns, outside the fields: a `dataclasses.replace` copy is a
        # new object, verified anew. `logit_bias` is a dict, which can change after a
        # verify: it is checked again every time (it is empty in the common case).
        if self.__dict__.get("_verified_for") == vocab_size:
            self._verify_logit_bias(vocab_size)
            return
        t = self.temperature
        if not math.isfinite(t) or t < 0:
            _fail(f"temperature must be a non-negative finite number, got {t}.")
        if not 0 < self.top_p <= 1:
            _fail(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0 <= self.min_p <= 1:
            _fail(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1:
            _fail(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not -2 <= self.frequency_penalty <= 2:
            _fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2 <= self.presence_penalty <= 2:
            _fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0 < self.repetition_penalty <= 2:
            _fail(
                "repetition_penalty must be in (0, 2] (1.0 = no penalty), "
                f"got {self.repetition_penalty}."
            )
        if self.min_new_tokens < 0:
            _fail(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}.")
        if self.max_new_tokens is not None:
            if self.max_new_tokens < 0:
                _fail(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
            if self.min_new_tokens > self.max_new_tokens:
                _fail(
                    f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                    f"got {self.min_new_tokens}."
                )
        self._verify_logit_bias(vocab_size)
        for token_id in sorted(self.stop_token_ids):
            if not 0 <= token_id < vocab_size:
                _fail(f"stop_token_ids must be in [0, {vocab_size - 1}], got {token_id}.")
        if self.n < 1:
            _fail(f"n must be at least 1, got {self.n}.")
        drafts = self.speculative_num_draft_tokens
        if drafts is not None and drafts < 0:
            _fail(f"speculative_num_draft_tokens must be at least 0, got {drafts}.")
        if self.stream_interval is not None and self.stream_interval < 1:
            _fail(f"stream_interval must be at least 1, got {self.stream_interval}.")
        if len(self.stop) > MAX_STOP_COUNT:
            _fail(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(self.stop)}")
        for stop in self.stop:
            if len(stop) > MAX_STOP_CHARS:
                _fail(
                    f"a stop string is {len(stop)} characters long, over the "
                    f"{MAX_STOP_CHARS}-character limit"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, "
                f"got {len(self.stop_token_ids)}"
            )
        if len(self.stop_regex) > MAX_STOP_REGEX_COUNT:
            _fail(
                f"at most {MAX_STOP_REGEX_COUNT} stop_regex patterns are allowed, "
                f"got {len(self.stop_regex)}"
            )
        for pattern in self.stop_regex:
            size = len(pattern.encode())
            if size > MAX_STOP_REGEX_BYTES:
                _fail(f"stop_regex is {size} bytes, over the {MAX_STOP_REGEX_BYTES}-byte limit")
        _ = self.stop_regex_patterns  # compiled now: a pattern that does not compile is a 400
        grammars = bool(self.regex) + bool(self.json_schema) + bool(self.ebnf)
        if grammars + bool(self.structural_tag) > 1:
            _fail("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
        for key in _UNSUPPORTED:
            if getattr(self, key):  # null and "" mean none
                _fail(f"{key} is not supported by this server yet.")
        self.__dict__["_verified_for"] = vocab_size

    def _verify_logit_bias(self, vocab_size: int) -> None:
        for token_id in self.logit_bias:
            if not 0 <= token_id < vocab_size:
                _fail(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")


def _fail(message: str) -> NoReturn:
    raise InvalidSamplingParams(message)


#: The largest |logit_bias|: 1e30 / 1e-6 (the lowest non-greedy temperature) still fits
#: float32 (about 3.4e38).
MAX_LOGIT_BIAS = 1e30


def _finite_float(key: str, value: int | float) -> float:
    """A JSON number as a float; integers too large for one are a 400, not an OverflowError."""
    try:
        return float(value)
    except OverflowError:
        _fail(f"{key} is out of range, got a number with {len(str(value))} digits.")


def _fault(key: str, value: Any) -> Any:
    """The field `key` did not convert (wire.convert): SGLang's words for its type, or the
    value repaired (an integral float where an integer is declared, as Python clients send)."""
    kind = _KINDS.get(key)
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        _fail(f"{key} must be an integer, got {value!r}.")
    if kind is float:
        if isinstance(value, int) and not isinstance(value, bool):
            return _finite_float(key, value)  # an integer too large for a float
        _fail(f"{key} must be a number, got {value!r}.")
    if kind is bool:
        _fail(f"{key} must be a boolean, got {value!r}.")
    if kind is str:
        _fail(f"{key} must be a string, got {value!r}.")
    if key in ("stop", "stop_regex"):
        _check_count(key, value)
        _fail(f"{key} must be a string or a list of strings, got {value!r}.")
    if key == "stop_token_ids":
        _check_count(key, value)
        _fail(f"stop_token_ids must be a list of integers, got {value!r}.")
    if key == "logit_bias":
        return _logit_bias(value)
    if key == "custom_params":
        _fail(f"custom_params must be an object, got {value!r}.")
    raise AssertionError(f"no fault message for {key}")  # every field is listed above


def _check(key: str, value: Any) -> None:
    """What `_normalize` checks beyond the JSON type, for `convert`'s slow path."""
    if key in ("stop", "stop_token_ids"):
        _check_count(key, value)
    elif key == "logit_bias" and value is not None:
        _logit_bias(value)


def _check_count(key: str, value: Any) -> None:
    """The list as sent, before empty entries are dropped: its length is what costs."""
    if not isinstance(value, list):
        return
    if key == "stop" and len(value) > MAX_STOP_COUNT:
        _fail(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(value)}")
    if key == "stop_token_ids" and len(value) > MAX_STOP_TOKEN_IDS:
        _fail(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(value)}")


def _logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, Mapping):
        _fail(f"logit_bias must be an object mapping token ids to numbers, got {value!r}.")
    bias: dict[int, float] = {}
    for k, v in value.items():
        try:
            token_id = int(k)
        except (TypeError, ValueError):
            _fail(f"logit_bias keys must be token ids, got {k!r}.")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            _fail(f"logit_bias values must be numbers, got {v!r}.")
        bias[token_id] = _finite_float("logit_bias values", v)
        if not math.isfinite(bias[token_id]) or abs(bias[token_id]) > MAX_LOGIT_BIAS:
            # Logits are float32, and the sampler divides them by the temperature (down
            # to 1e-6): a larger bias would become inf there.
            _fail(
                f"logit_bias values must be finite numbers within ±{MAX_LOGIT_BIAS:g}, got {v!r}."
            )
    return bias


def _strings(value: str | list[str]) -> tuple[str, ...]:
    """`stop` and `stop_regex`: one string or a list; empty entries dropped."""
    if isinstance(value, str):
        return (value,) if value else ()
    return tuple(s for s in value if s)


def _normalize(body: SamplingParamsBody, keys: Iterable[str]) -> dict[str, Any]:
    """The declared body as SamplingParams' keyword arguments: nulls dropped (defaults),
    lists as tuples and sets, logit_bias keys as ids. `keys` are the body's own (no other
    field can be set), in its order, so that its first problem is the one reported."""
    kwargs: dict[str, Any] = {}
    for key in keys:
        value = getattr(body, key)
        if value is None:
            if key == "max_new_tokens":
                kwargs[key] = None  # explicit null: unbounded
            continue
        convert_value = _CONVERT.get(key)
        kwargs[key] = value if convert_value is None else convert_value(key, value)
    return kwargs


def _stop_ids(key: str, value: list[int | None]) -> frozenset[int]:
    _check_count(key, value)
    return frozenset(x for x in value if x is not None)


def _stops(key: str, value: str | list[str]) -> tuple[str, ...]:
    _check_count(key, value)
    return _strings(value)


_CONVERT: dict[str, Any] = {
    "stop": _stops,
    "stop_regex": lambda key, value: _strings(value),
    "stop_token_ids": _stop_ids,
    "logit_bias": lambda key, value: _logit_bias(value),
}
_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
#: The declared fields, in declaration order.
_FIELD_ORDER = tuple(f.name for f in msgspec.structs.fields(SamplingParamsBody))


def _scalar_kind(hint: Any) -> type | None:
    """int, float, bool or str for a field declared as one of them (or null)."""
    union = typing.get_args(typing.get_args(hint)[0])
    args = [a for a in union if a not in (types.NoneType, UnsetType)]
    return args[0] if len(args) == 1 and args[0] in (int, float, bool, str) else None


#: The JSON type of every scalar field, for its type error's words.
_KINDS = {
    key: kind
    for key, hint in typing.get_type_hints(SamplingParamsBody, include_extras=True).items()
    if (kind := _scalar_kind(hint)) is not None
}
