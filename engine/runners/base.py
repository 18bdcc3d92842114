"""The contract between the scheduler and a model runner.

The scheduler owns all request state; a runner owns the model, the KV cache and one sampler
per sequence, and knows nothing of requests, rids or channels. One scheduler task calls the
runner, so a runner never sees two calls at once, but for one case: while a `decode_run`
goes on, the scheduler may close sequences that ended (committing a run's tokens, in its
own task or in one that aborts a request).

Optional features are sub-protocols a runner has or lacks, checked once with `isinstance`
when the engine starts: `DecodesRuns`, `ReusesKV`, `ReportsKVBytes`, `FindsSpecialTokens`,
`BoundsTokenCount`, `StopsDecoding`, `VerifiesDrafts`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from ..grammar import Grammars
from ..logits import LogitHooks
from ..request import ModelInfo, hot_record
from ..sampling import SamplingParams

__all__ = [
    "BoundsTokenCount",
    "DecodeRun",
    "DecodesRuns",
    "FindsSpecialTokens",
    "KVRestore",
    "KVSave",
    "KVState",
    "ReportsKVBytes",
    "ReusesKV",
    "RunFeed",
    "Runner",
    "SeqStep",
    "StopsDecoding",
    "VerifiesDrafts",
    "Verify",
]


class KVState(Protocol):
    """A snapshot of one slot's KV cache, in host memory, as a runner made it (opaque to the
    engine, which only keeps it in the prefix cache and hands it back)."""

    @property
    def n_tokens(self) -> int:
        """The positions it holds: 0 .. n_tokens - 1."""
        ...

    @property
    def nbytes(self) -> int:
        """Host memory it holds, for the prefix cache's bound."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class KVRestore:
    """Load `state` into the entry's (empty) slot before its tokens, keeping positions
    `0 .. n_tokens - 1` only (`n_tokens <= state.n_tokens`; the entry's start_pos is
    n_tokens). An entry with no tokens (and no `fork_from`) that samples takes its token
    from `logits`, the saved row after position n_tokens - 1 (a whole prompt restored)."""

    state: KVState
    n_tokens: int
    logits: np.ndarray | None = None


@dataclasses.dataclass(slots=True)
class KVSave:
    """Asks the runner for a snapshot of the entry's slot right after its tokens are
    computed; the runner sets `state` before `step` returns, and with `with_logits` (an
    entry that samples) `logits`, a copy of the row it samples from, taken before any
    suppression, hook or sampler writes into it."""

    state: KVState | None = None
    with_logits: bool = False
    logits: np.ndarray | None = None


@dataclasses.dataclass(slots=True)
class Verify:
    """Marks an entry whose `tokens[1:]` are drafts (speculative decoding). The runner
    computes logits at every position of `tokens`, samples position 0 with the slot's sampler,
    and goes on while the token sampled equals the next draft: `accepted` drafts are kept,
    and the token it returns is the one sampled after them (at position `start_pos +
    accepted`); the KV of the rejected drafts is removed, so the slot then holds positions
    up to `start_pos + accepted`. The sampler sees exactly the tokens kept, in order."""

    accepted: int = 0


@hot_record
class SeqStep:
    """One sequence's share of a step."""

    seq_id: int  # runner slot, 0 <= seq_id < max_running_requests
    tokens: list[int]  # fed this step: a prompt chunk, or the last sampled token
    start_pos: int  # KV position of tokens[0]
    sample: bool  # sample a next token after this step (decode, or the last prompt chunk)
    #: Token ids that must not be sampled this step (EOS and stop tokens before
    #: min_new_tokens is reached).
    suppress: frozenset[int] = frozenset()
    #: Per-sequence logits work (grammar, custom processor, logprobs); None for most
    #: requests, which then cost nothing extra. See engine/logits.py for the call order.
    hooks: LogitHooks | None = None
    #: Prompt logprobs: the logits after `tokens[prompt_offset + j]` score
    #: `prompt_targets[j]` (through `hooks.score_prompt`). None: score no prompt position.
    prompt_targets: list[int] | None = None
    prompt_offset: int = 0
    #: KV reuse (runners with `reuses_kv`): restore a snapshot into the slot first; snapshot
    #: the slot after this entry's tokens; or, for an entry with no tokens, fork: copy slot
    #: `fork_from`'s KV (as its own entry in this plan left it) and sample this entry's token
    #: from that entry's logits, with this slot's sampler.
    restore: KVRestore | None = None
    save: KVSave | None = None
    fork_from: int | None = None
    #: The runner may decode this entry's sampled token ahead, for the next step (the
    #: overlap): False when the scheduler will hold that decode back (a burst's prefill).
    decode_ahead: bool = True
    #: Draft verification (runners that `VerifiesDrafts`): `tokens` is [last token, d1 .. dk]
    #: and the runner sets `verify.accepted` (see `Verify`).
    verify: Verify | None = None


def nothing_decoded() -> None:
    """`DecodeRun.feed_decoded` outside a run: nothing to hand over."""


class DecodeRun:
    """A step that goes on decoding: after its first tokens are sampled, every entry is fed
    its own sampled token and sampled again, decode after decode, with nothing planned in
    between, until the run ends. What the engine asks of a runner that `decodes_runs`.

    The plan of a run holds only decodes (one token each, `sample=True`, no `suppress`, no
    `hooks`, no KV reuse), so every decode of it is what the next step's plan would have
    been, computed in the same batch; tokens come out as steps would give them.

    The run ends after the decode in which any of these holds: `limit` decodes have been
    made (the first included); some entry sampled a token in its `stop_ids` (it ends its
    request: nothing after it would be kept); `stop()` was called (on the event loop: a
    request arrived while a slot is free, one was aborted, one ended while others wait for
    a slot, the feed failed, the engine is closing). A runner may also end it early, for
    one step per token again (the llama runner does when the event loop lags). An entry whose
    sequence the scheduler closes during the run (`close_sequence`) is decoded no further.
    """

    __slots__ = ("feed_decoded", "limit", "stop_ids", "stopped", "wake_each")

    def __init__(self, *, limit: int, stop_ids: Sequence[frozenset[int]], wake_each: bool) -> None:
        #: Decodes at most, the first included (at least 2).
        self.limit = limit
        #: Per entry, in plan order: tokens after which the run ends.
        self.stop_ids = stop_ids
        #: Hand each decode's tokens over as soon as it is sampled (some request streams
        #: them, or has stop strings to check); else at the end of the run, all together.
        self.wake_each = wake_each
        self.stopped = False
        #: Set by the runner: hands the decodes sampled so far, and not yet handed over, to
        #: the feed at once (on the event loop, from whichever task aborts a request; a
        #: feed that fails there is the run's failure, raised from `decode_run`). The
        #: scheduler calls it before it marks a request of the run aborted, so that the
        #: tokens decoded before an abort are kept, as single steps would have committed
        #: them. The runner puts `nothing_decoded` back when the run ends (so that no
        #: reference cycle outlives it).
        self.feed_decoded: Callable[[], None] = nothing_decoded

    def stop(self) -> None:
        """End the run after the decode that is running (from any thread)."""
        self.stopped = True


#: What a runner hands the engine's scheduler from a run: the tokens of one or more decodes,
#: oldest first, each one token per plan entry in plan order (-1 for an entry closed
#: meanwhile). Called on the event loop, in the scheduler's task (and, through
#: `DecodeRun.feed_decoded`, in a task that aborts a request); it must not block.
RunFeed = Callable[[list[list[int]]], None]


class Runner(Protocol):
    info: ModelInfo

    @property
    def grammars(self) -> Grammars | None:
        """Compiles requests' grammars (regex, json_schema, ebnf) for this vocabulary; None
        if this runner cannot constrain decoding."""
        ...

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        """The ids of `text`. Called on the event loop for short texts and from a worker
        thread for long ones (the engine's `prepare`, `/tokenize`), possibly while a step
        runs: it must only read the vocabulary. A runner that `BoundsTokenCount` also bounds
        the ids in linear time, which the engine checks against the context before
        tokenizing a long text."""
        ...

    def token_piece(self, token_id: int, *, special: bool) -> bytes:
        """The bytes of one token; control tokens render empty unless `special`."""
        ...

    def open_sequence(self, seq_id: int, params: SamplingParams) -> None:
        """Prepare slot `seq_id` (its KV is empty) with a sampler for `params`."""
        ...

    def close_sequence(self, seq_id: int) -> None:
        """Free the slot's KV cells and sampler. Idempotent."""
        ...

    async def step(self, plan: Sequence[SeqStep]) -> list[int]:
        """Run one forward pass over `plan` and sample where asked.

        Returns one token id per entry with `sample=True`, in plan order. An entry with
        `hooks` has its sampling row passed through `hooks.prepare` before sampling and
        `hooks.sampled` after, and its `prompt_targets` scored. Raises
        RunnerFailure if the forward pass failed; the sequences in `plan` are then in an
        unknown state and the scheduler closes them.
        """
        ...

    def kv_used_cells(self) -> int:
        """KV cells occupied right now, as the backend itself counts them."""
        ...

    def close(self) -> None:
        """Free the model. Called once, after the last step has returned."""
        ...


# -- optional features ------------------------------------------------------------------
# A runner has each one or not; the engine asks once, with `isinstance`, when it starts.


@runtime_checkable
class DecodesRuns(Protocol):
    """A runner with `decode_run(plan, run, feed)` (said with a true `decodes_runs`
    attribute): a step that goes on decoding until the run ends (`DecodeRun`), handing each
    decode's tokens to `feed` as the run says, without returning to the scheduler between
    decodes. The engine then plans a run whenever every running sequence is simply
    decoding; other runners get one `step` per token."""

    decodes_runs: bool

    async def decode_run(self, plan: Sequence[SeqStep], run: DecodeRun, feed: RunFeed) -> None: ...


@runtime_checkable
class ReusesKV(Protocol):
    """A runner whose `step` takes `SeqStep.restore`, `save` and `fork_from` (said with a
    true `reuses_kv` attribute). The engine runs its prefix cache and forks parallel samples
    only for such runners; others prefill every prompt, as before.

    A runner whose snapshots keep only the last N positions of some layers (sliding-window
    attention) says so with a `kv_window = N` attribute: the prefix cache then restores a
    snapshot only whole, or cut short if it is no longer than N (engine/prefix_cache.py)."""

    reuses_kv: bool


@runtime_checkable
class ReportsKVBytes(Protocol):
    """A runner that says how much memory its KV cache took when it loaded (`/metrics`,
    `kv_cache_bytes`; 0 for others)."""

    #: Bytes of KV the context allocates, fixed once the runner is built.
    kv_bytes: int


@runtime_checkable
class FindsSpecialTokens(Protocol):
    """A runner that knows what its vocabulary's special tokens begin with (the llama
    runner), so the engine can weigh what tokenizing a text costs."""

    @property
    def special_marks(self) -> str | None:
        """The characters this vocabulary's special tokens begin with (None: too many to
        count), for weighing what tokenizing a text costs (`offload.work`)."""
        ...


@runtime_checkable
class BoundsTokenCount(Protocol):
    """A runner that bounds a text's token count without tokenizing it (the llama runner),
    so the engine can refuse a text that can never fit the context before tokenizing it."""

    def tokens_at_least(self, text: str) -> int:
        """A lower bound on `len(tokenize(text))` in linear time, without tokenizing."""
        ...


@runtime_checkable
class VerifiesDrafts(Protocol):
    """A runner whose `step` takes `SeqStep.verify` entries (said with a true
    `verifies_drafts` attribute); the engine drafts tokens (speculative decoding) only for
    such runners."""

    verifies_drafts: bool


@runtime_checkable
class StopsDecoding(Protocol):
    """A runner that can give up its decodes midway (the llama runner: at llama.cpp's next
    graph node). The engine calls `stop_decoding()` as it closes, with its scheduler's
    cancellation, so that its exit waits for no decode to finish (under CPU load one can
    take seconds); the step or run in progress then ends with that cancellation."""

    def stop_decoding(self) -> None:
        """From any thread; after it the runner is only fit for `close`."""
        ...
