"""SGLang's `SamplingParams`: fields, defaults, normalization and validation messages.

Synopsis::

    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 16})
    params.verify(vocab_size)        # raises InvalidSamplingParams with SGLang's wording

`from_dict` does what SGLang's `SamplingParams(**d)` + `__post_init__` do (unknown keys are an
error; an explicit null means the default, except `max_new_tokens`, where null means unbounded),
and `verify` does what `SamplingParams.verify(vocab_size)` does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, NoReturn

# Not `import regex`: a SamplingParams field has that name.
import regex as regex_pkg  # type: ignore[import-untyped]

from .errors import InvalidSamplingParams
from .grammar_bounds import stop_regex_problem

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
        known = _FIELD_NAMES
        unknown = sorted(k for k in obj if k not in known)
        if unknown:
            raise InvalidSamplingParams(
                f"unknown field `{unknown[0]}` in sampling_params, expected one of "
                + ", ".join(f"`{k}`" for k in sorted(known))
            )
        kwargs: dict[str, Any] = {}
        for key, value in obj.items():
            if value is None and key != "max_new_tokens":
                continue  # an explicit null resets to the default
            kwargs[key] = _coerce(key, value)
        temperature = kwargs.get("temperature", 1.0)
        if isinstance(temperature, float) and 0 <= temperature < GREEDY_TEMPERATURE:
            kwargs["temperature"] = 1.0
            kwargs["top_k"] = 1
        if kwargs.get("top_k") == -1:
            kwargs["top_k"] = TOP_K_ALL
        return cls(**kwargs)

    def verify(self, vocab_size: int) -> None:
        """SGLang's checks, in SGLang's order, with its messages."""
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
        for token_id in self.logit_bias:
            if not 0 <= token_id < vocab_size:
                _fail(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
        for token_id in sorted(self.stop_token_ids):
            if not 0 <= token_id < vocab_size:
                _fail(f"stop_token_ids must be in [0, {vocab_size - 1}], got {token_id}.")
        if self.n < 1:
            _fail(f"n must be at least 1, got {self.n}.")
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
        grammars = (self.regex, self.json_schema, self.ebnf, self.structural_tag)
        if sum(bool(x) for x in grammars) > 1:
            _fail("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
        for key in _UNSUPPORTED:
            if getattr(self, key):  # null and "" mean none
                _fail(f"{key} is not supported by this server yet.")


def _fail(message: str) -> NoReturn:
    raise InvalidSamplingParams(message)


_INT_KEYS = {"max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval", "sampling_seed"}
_FLOAT_KEYS = {
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
}
_BOOL_KEYS = {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
_STR_KEYS = {"json_schema", "regex", "ebnf", "structural_tag"}


#: The largest |logit_bias|: 1e30 / 1e-6 (the lowest non-greedy temperature) still fits
#: float32 (about 3.4e38).
MAX_LOGIT_BIAS = 1e30


def _finite_float(key: str, value: int | float) -> float:
    """A JSON number as a float; integers too large for one are a 400, not an OverflowError."""
    try:
        return float(value)
    except OverflowError:
        _fail(f"{key} is out of range, got a number with {len(str(value))} digits.")


def _coerce(key: str, value: Any) -> Any:
    """Check one value's JSON type and convert it to the field's Python type."""
    if key in _INT_KEYS:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            _fail(f"{key} must be an integer, got {value!r}.")
        return value
    if key in _FLOAT_KEYS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(f"{key} must be a number, got {value!r}.")
        return _finite_float(key, value)
    if key in _BOOL_KEYS:
        if not isinstance(value, bool):
            _fail(f"{key} must be a boolean, got {value!r}.")
        return value
    if key in _STR_KEYS:
        if not isinstance(value, str):
            _fail(f"{key} must be a string, got {value!r}.")
        return value
    if key == "stop":
        stops = [value] if isinstance(value, str) else value
        if isinstance(stops, list) and len(stops) > MAX_STOP_COUNT:
            _fail(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stops)}")
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            _fail(f"stop must be a string or a list of strings, got {value!r}.")
        return tuple(s for s in stops if s)
    if key == "stop_regex":
        patterns = [value] if isinstance(value, str) else value
        if not isinstance(patterns, list) or not all(isinstance(s, str) for s in patterns):
            _fail(f"stop_regex must be a string or a list of strings, got {value!r}.")
        return tuple(s for s in patterns if s)
    if key == "stop_token_ids":
        ids = value if isinstance(value, list) else None
        if ids is not None and len(ids) > MAX_STOP_TOKEN_IDS:
            # Checked before the set is built: the list as sent is what costs.
            _fail(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(ids)}")
        if ids is None or not all(
            x is None or (isinstance(x, int) and not isinstance(x, bool)) for x in ids
        ):
            _fail(f"stop_token_ids must be a list of integers, got {value!r}.")
        return frozenset(x for x in ids if x is not None)
    if key == "logit_bias":
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
                    f"logit_bias values must be finite numbers within ±{MAX_LOGIT_BIAS:g}, "
                    f"got {v!r}."
                )
        return bias
    if key == "custom_params":
        if not isinstance(value, Mapping):
            _fail(f"custom_params must be an object, got {value!r}.")
        return value
    raise AssertionError(f"no coercion for {key}")  # every dataclass field is listed above


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
