"""What goes into the engine (`GenerateRequest`) and what comes out (`Frame`, `Done`, `Error`).

A request's output is a sequence of zero or more `Frame`s followed by exactly one terminal
item, `Done` or `Error`. Every item carries a *delta* (`text`, `output_ids` produced since the
previous item) and *cumulative* counts, so a consumer can build either SGLang streaming shape.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, TypeAlias, TypeVar, dataclass_transform

from .errors import EngineError
from .placement import Placement
from .repack import WeightsRepack
from .sampling import SamplingParams

__all__ = [
    "TERMINAL",
    "Done",
    "EngineStats",
    "Error",
    "FinishReason",
    "Frame",
    "GenerateRequest",
    "LogprobRequest",
    "Logprobs",
    "ModelInfo",
    "Output",
    "SpecCounts",
    "TokenLogprob",
    "TopLogprobs",
    "WorkerStats",
    "abort_reason",
    "length_reason",
    "stop_reason",
]

T = TypeVar("T")
_C = TypeVar("_C", bound=type)


@dataclass_transform(frozen_default=True)
def hot_record(cls: _C) -> _C:
    """A slotted dataclass that type checkers treat as frozen, without `frozen=True`'s cost
    at run time: a frozen dataclass sets each field through `object.__setattr__`, which
    triples the cost of building one (0.66 against 0.21 µs for a `Frame`). The engine builds
    one `Frame` and one `SeqStep` per token, so the items on that path use this."""
    # unsafe_hash: the field-wise __hash__ a frozen dataclass gets, which type checkers expect.
    return dataclasses.dataclass(slots=True, unsafe_hash=True)(cls)  # type: ignore[return-value]


#: SGLang's finish_reason objects, kept as plain dicts in SGLang's key order.
FinishReason: TypeAlias = dict[str, Any]


def length_reason(length: int) -> FinishReason:
    return {"type": "length", "length": length}


def stop_reason(matched: int | str) -> FinishReason:
    return {"type": "stop", "matched": matched}


#: The rid prefix of the server's own health probes (SGLang's): they are not client requests,
#: so they are left out of the request counters (`EngineStats.aborted_requests`).
HEALTH_CHECK_PREFIX = "HEALTH_CHECK_"


def counts_as_request(rid: str) -> bool:
    """Whether a request with this rid is counted in the engine's request counters."""
    return not rid.startswith(HEALTH_CHECK_PREFIX)


def abort_targets(live: Mapping[str, T], rid: str, *, fanout: bool) -> list[T]:
    """What `abort(rid, fanout=...)` reaches among the in-flight requests `live` (by rid):
    `rid` itself and, with `fanout`, the items a batch fanned out from it (`rid_0`,
    `rid_1`, ...), never other rids that merely share a prefix."""
    found = [live[rid]] if rid in live else []
    if fanout:
        family = re.compile(re.escape(rid) + r"_\d+")
        found += [value for key, value in live.items() if family.fullmatch(key)]
    return found


def abort_reason(
    message: str = "Aborted", *, status_code: int | None = None, err_type: str | None = None
) -> FinishReason:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


#: (logprob, token id); the logprob is None only for the first scored prompt position.
TokenLogprob: TypeAlias = tuple[float | None, int]
#: One position's alternatives, (logprob, token id) each; None where nothing was scored.
TopLogprobs: TypeAlias = list[tuple[float, int]] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogprobRequest:
    """What to score besides sampling: SGLang's `return_logprob` family.

    Logprobs are the log-softmax over the whole vocabulary of the logits the sampler sees
    before temperature, top-k/top-p/min-p: after logit_bias, the min_new_tokens mask, a
    grammar's mask and a custom logit processor (SGLang's order), so they are not scaled by
    temperature and a token a grammar forbids has -inf.
    """

    #: -1: output positions only; k >= 0: also prompt positions k.. (position k itself has
    #: no logprob: nothing precedes it in the scored window).
    start_len: int = -1
    #: Alternatives per position, most likely first (0: none).
    top_n: int = 0
    #: Always report these ids' logprobs at every position (None: none).
    token_ids: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One generation. Exactly one of `text` and `input_ids` is used (`input_ids` wins)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    #: Client request id; the engine makes a uuid4 hex one when absent.
    rid: str | None = None
    #: Score tokens (None: no logprobs).
    logprobs: LogprobRequest | None = None
    #: SGLang's serialized `CustomLogitProcessor` (`{"callable": <dill hex>}`); refused unless
    #: the engine was configured with `enable_custom_logit_processor`.
    custom_logit_processor: str | None = None
    #: Someone reads the frames as they come (SGLang's `stream`). False (a unary answer,
    #: which only needs the end): frames may come later, several tokens in one, so the
    #: engine need not wake for every token; the text, ids and timing stamps are the same.
    stream: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class Logprobs:
    """The logprobs that came with one output item.

    Output families cover exactly this item's new `output_ids`. Input (prompt) families come
    once, with the first item of a request that asked for them, and are None afterwards.
    `top`/`ids` families are None when not asked for.
    """

    output_token: list[TokenLogprob]
    output_top: list[TopLogprobs] | None = None
    output_ids: list[TopLogprobs] | None = None
    input_token: list[TokenLogprob] | None = None
    input_top: list[TopLogprobs] | None = None
    input_ids: list[TopLogprobs] | None = None


@hot_record
class Frame:
    """A non-terminal output: the delta since the previous item, and cumulative counts."""

    rid: str
    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: Logprobs | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class SpecCounts:
    """A request's speculative decoding (engine/speculative.py), in SGLang's meta_info terms:
    `verify_ct` steps verified drafts, `draft_tokens` were drafted and `accepted_tokens` of
    them kept (a draft kept past a stop is still counted)."""

    verify_ct: int
    draft_tokens: int
    accepted_tokens: int


@hot_record
class Done:
    """The terminal output: the last delta and SGLang's finish_reason."""

    rid: str
    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason
    logprobs: Logprobs | None = None
    #: Trio clock (`trio.current_time()`) when the request left the waiting queue for a
    #: running slot (None: it never did, e.g. aborted while waiting).
    admitted_at: float | None = None
    #: Trio clock when its first output token was sampled (None: no token was).
    first_token_at: float | None = None
    #: The e2e_latency a remote worker reported for its part (None: served locally).
    worker_e2e_latency: float | None = None
    #: Its speculative decoding, if it speculated (None: it never could).
    speculative: SpecCounts | None = None


@hot_record
class Error:
    """A terminal failure. `error.http_status` says how HTTP should report it."""

    rid: str
    error: EngineError


Output: TypeAlias = Frame | Done | Error

#: For `isinstance(item, TERMINAL)`: the item that ends a request's output (a tuple is three
#: times faster to test than `Done | Error`, and the test runs for every token).
TERMINAL = (Done, Error)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelInfo:
    name: str
    path: str
    context_length: int  # the longest prompt + completion one request may have
    train_context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]  # every end-of-generation token (llama_vocab_is_eog)
    eos_token_id: int | None  # *the* EOS token (what chat templates call eos_token)
    bos_token_id: int | None
    chat_template: str | None
    #: Where the layers and KV cache went (`/get_server_info`'s `placement`); None for
    #: engines without local layers (sim, a front).
    placement: Placement | None = None
    #: Whether llama.cpp repacked the weights, and why (`/get_server_info`'s
    #: `weights_repack`); None for engines without local weights.
    weights_repack: WeightsRepack | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineStats:
    """A snapshot of the scheduler, for metrics and tests."""

    running: int  # sequences holding KV cells
    waiting: int  # submitted, not yet admitted
    kv_used_cells: int  # KV cells actually occupied, as the runner reports them
    kv_total_cells: int
    steps: int  # scheduler steps run so far
    generated_tokens: int  # tokens sampled so far, all requests
    #: Requests that ended aborted (any abort finish_reason: /abort_request, a client that
    #: left, shutdown) or were refused by a full queue, since the engine opened; the
    #: server's own health probes (`HEALTH_CHECK_PREFIX`) are not counted.
    aborted_requests: int = 0
    kv_cache_bytes: int = 0  # memory the runner's KV cache allocates (0: not reported)
    prefix_cache_bytes: int = 0  # host memory the prefix cache holds now
    prefix_cache_entries: int = 0
    prefix_cache_hits: int = 0  # admissions that restored a cached prefix, so far
    #: Speculative decoding so far: steps that verified drafts, tokens drafted, drafts kept.
    spec_verifies: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerStats:
    """One remote worker as the front sees it, for /workers and /metrics."""

    url: str
    kind: str  # "sglang" or "openai"
    breaker: str  # "closed", "open" or "half_open"
    healthy: bool
    in_flight: int
    requests_total: int
    errors_total: int
    retries_total: int
    breaker_opened_total: int
