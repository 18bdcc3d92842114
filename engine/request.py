"""What goes into the engine (`GenerateRequest`) and what comes out (`Frame`, `Done`, `Error`).

A request's output is a sequence of zero or more `Frame`s followed by exactly one terminal
item, `Done` or `Error`. Every item carries a *delta* (`text`, `output_ids` produced since the
previous item) and *cumulative* counts, so a consumer can build either SGLang streaming shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeAlias

from .errors import EngineError
from .sampling import SamplingParams

__all__ = [
    "Done",
    "EngineStats",
    "Error",
    "FinishReason",
    "Frame",
    "GenerateRequest",
    "ModelInfo",
    "Output",
    "abort_reason",
    "length_reason",
    "stop_reason",
]

#: SGLang's finish_reason objects, kept as plain dicts in SGLang's key order.
FinishReason: TypeAlias = dict[str, Any]


def length_reason(length: int) -> FinishReason:
    return {"type": "length", "length": length}


def stop_reason(matched: int | str) -> FinishReason:
    return {"type": "stop", "matched": matched}


def abort_reason(
    message: str = "Aborted", *, status_code: int | None = None, err_type: str | None = None
) -> FinishReason:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One generation. Exactly one of `text` and `input_ids` is used (`input_ids` wins)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    #: Client request id; the engine makes a uuid4 hex one when absent.
    rid: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """A non-terminal output: the delta since the previous item, and cumulative counts."""

    rid: str
    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """The terminal output: the last delta and SGLang's finish_reason."""

    rid: str
    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason


@dataclasses.dataclass(frozen=True, slots=True)
class Error:
    """A terminal failure. `error.http_status` says how HTTP should report it."""

    rid: str
    error: EngineError


Output: TypeAlias = Frame | Done | Error


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineStats:
    """A snapshot of the scheduler, for metrics and tests."""

    running: int  # sequences holding KV cells
    waiting: int  # submitted, not yet admitted
    kv_used_cells: int  # KV cells actually occupied, as the runner reports them
    kv_total_cells: int
    steps: int  # scheduler steps run so far
    generated_tokens: int  # tokens sampled so far, all requests
