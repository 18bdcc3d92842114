"""A deterministic stand-in for a model, for scheduling, timing and cancellation tests.

Synopsis::

    EngineConfig(runner="sim", sim_latency=SimLatency(step_base=0.01))

- Tokens are bytes: id = byte + 3, plus three control tokens (0 `<|endoftext|>`,
  1 `<|im_start|>`, 2 `<|im_end|>`; 0 and 2 end generation). Any UTF-8 text round-trips.
- Output is a pure function of (prompt, position) when greedy, of (seed, position) with a
  `sampling_seed`, and random otherwise; it is lowercase letters and spaces. A positive
  `logit_bias` forces its token, as +100 does on a real model; `suppress` is honoured.
- Each step sleeps on Trio's clock for the cost `SimLatency` gives, so under
  `autojump_clock` latencies are exact.
- `fail_at_step=N` makes step N raise RunnerFailure, for fault tests.
- Decode runs (`decodes_runs`): each decode of a run costs what a step of the same entries
  would, and counts as a step (for `fail_at_step`); its tokens are fed after each decode when
  the run wakes for each, else all at the run's end, as the llama runner hands them over.
- KV reuse (`reuses_kv`): a snapshot is the tokens fed so far (`kv_bytes_per_token` each, for
  the prefix cache's bound); restoring and forking cost no time, and output after them is
  what prefilling would have given, as on the real model (a whole prompt restored samples
  its first token from its fed tokens, as from the saved row on the real model).
- Logits, for the hooks (logprobs, custom logit processors): every token has logit 0 but the
  one the sim would pick, which has `SIM_PICK_LOGIT`; if a hook (a mask, a bias, a processor)
  leaves another token higher, the highest is sampled. Prompt positions score as all-zero rows.
- Draft verification (`verifies_drafts`): a verified entry costs one decode; it feeds its
  tokens one at a time and samples after each while the sample is the next draft (exactly
  what single decodes would sample), then forgets the rejected drafts.
- Embeddings (`sim_embed.py`): sim-only fake vectors, a fixed function of the token ids.

It is never used unless asked for by name (`runner="sim"`).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

import numpy as np
import trio

from ..config import SimLatency
from ..errors import RunnerFailure
from ..request import ModelInfo
from ..sampling import SamplingParams
from .base import DecodeRun, KVRestore, RunFeed, SeqStep, Verify, nothing_decoded
from .sim_embed import SimEmbeddings

__all__ = ["SimRunner"]

_SPECIAL = {0: b"<|endoftext|>", 1: b"<|im_start|>", 2: b"<|im_end|>"}
_BYTE_OFFSET = 3
VOCAB_SIZE = 256 + _BYTE_OFFSET
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz "
#: The logit of the token the sim picks; all others have 0.
SIM_PICK_LOGIT = 5.0


class SimRunner(SimEmbeddings):
    reuses_kv = True
    verifies_drafts = True

    def __init__(
        self,
        *,
        context_length: int = 8192,
        latency: SimLatency | None = None,
        fail_at_step: int | None = None,
        kv_bytes_per_token: int = 1024,
        chat_template: str | None = None,
    ) -> None:
        self.info = ModelInfo(
            name="sim",
            path="sim",
            context_length=context_length,
            train_context_length=context_length,
            vocab_size=VOCAB_SIZE,
            eos_token_ids=frozenset({0, 2}),
            eos_token_id=2,
            bos_token_id=None,
            chat_template=chat_template,
        )
        #: No grammar engine: constrained decoding needs a real vocabulary (llama runner).
        self.grammars = None
        self.latency = latency or SimLatency()
        self.fail_at_step = fail_at_step
        self.kv_bytes_per_token = kv_bytes_per_token
        self.steps = 0
        self._seqs: dict[int, _SimSeq] = {}

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return [b + _BYTE_OFFSET for b in text.encode()]

    def token_piece(self, token_id: int, *, special: bool) -> bytes:
        if token_id in _SPECIAL:
            return _SPECIAL[token_id] if special else b""
        return bytes([token_id - _BYTE_OFFSET])

    def open_sequence(self, seq_id: int, params: SamplingParams) -> None:
        assert seq_id not in self._seqs, f"slot {seq_id} is busy"
        self._seqs[seq_id] = _SimSeq(params)

    def close_sequence(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    async def step(self, plan: Sequence[SeqStep]) -> list[int]:
        self.steps += 1
        decoding = sum(1 for s in plan if len(s.tokens) == 1 and self._seqs[s.seq_id].prefilled)
        verifying = [s for s in plan if s.verify is not None]  # one decode each
        prefill = sum(len(s.tokens) for s in plan) - decoding
        prefill -= sum(len(s.tokens) for s in verifying)
        decoding += len(verifying)
        lat = self.latency
        await trio.sleep(
            lat.step_base + lat.decode_per_seq * decoding + lat.prefill_per_token * prefill
        )
        if self.fail_at_step == self.steps:
            raise RunnerFailure(f"sim runner: injected failure at step {self.steps}")
        sampled = []
        for s in plan:
            if s.restore is not None:
                self._seqs[s.seq_id].load(s.restore)
        for s in plan:
            seq = self._seqs[s.seq_id]
            if s.fork_from is not None:  # its leader comes first in the plan
                leader = self._seqs[s.fork_from].snapshot(self.kv_bytes_per_token)
                seq.load(KVRestore(leader, leader.n_tokens))
            assert s.start_pos == seq.kv_len, "positions must continue the sequence"
            if s.verify is not None:
                sampled.append(seq.verify(s.tokens, s.verify))
                continue
            seq.feed(s.tokens)
            if s.save is not None:
                s.save.state = seq.snapshot(self.kv_bytes_per_token)
                if s.save.with_logits:  # (a sim row: what the bound counts; sampling needs none)
                    s.save.logits = np.zeros(VOCAB_SIZE, dtype=np.float32)
            if s.hooks is not None and s.prompt_targets:
                rows = np.zeros((len(s.prompt_targets), VOCAB_SIZE), dtype=np.float32)
                s.hooks.score_prompt(rows, s.prompt_targets)
            if s.sample:
                seq.prefilled = True
                token = seq.sample(s.suppress)
                if s.hooks is not None:
                    row = np.zeros(VOCAB_SIZE, dtype=np.float32)
                    row[token] = SIM_PICK_LOGIT
                    row[list(s.suppress)] = -np.inf  # as the llama runner does first
                    s.hooks.prepare(row)
                    if row[token] < row.max():  # a hook moved the pick
                        token = int(np.argmax(row))
                    s.hooks.sampled(row, token)
                sampled.append(token)
        return sampled

    decodes_runs = True

    async def decode_run(self, plan: Sequence[SeqStep], run: DecodeRun, feed: RunFeed) -> None:
        tokens = await self.step(plan)
        held = [tokens]
        failure: list[Exception] = []

        def feed_decoded() -> None:
            decoded = held[:]
            held.clear()
            if decoded and not failure:
                try:
                    feed(decoded)
                except Exception as exc:  # as the llama runner: raised from decode_run
                    failure.append(exc)
                    run.stop()

        run.feed_decoded = feed_decoded
        decodes = 1
        live = list(range(len(plan)))
        try:
            while (
                decodes < run.limit
                and not run.stopped
                and not any(t in stop for t, stop in zip(tokens, run.stop_ids, strict=True))
            ):
                if run.wake_each:
                    feed_decoded()
                    if run.stopped:  # the feed may end the run (a request finished, say)
                        break
                live = [k for k in live if plan[k].seq_id in self._seqs and tokens[k] >= 0]
                if not live:
                    break
                entries = [
                    SeqStep(plan[k].seq_id, [tokens[k]], plan[k].start_pos + decodes, True)
                    for k in live
                ]
                sampled = iter(await self.step(entries))
                tokens = [-1] * len(plan)
                for k in live:
                    tokens[k] = next(sampled)
                held.append(tokens)
                decodes += 1
        finally:
            # What was decoded before a failure is handed over first, as llama's is.
            feed_decoded()
            run.feed_decoded = nothing_decoded
        if failure:
            raise failure[0]

    def kv_used_cells(self) -> int:
        return sum(seq.kv_len for seq in self._seqs.values())

    def close(self) -> None:
        self._seqs.clear()


class SimKVState:
    __slots__ = ("n_tokens", "nbytes", "tokens")

    def __init__(self, tokens: tuple[int, ...], nbytes: int) -> None:
        self.tokens = tokens
        self.n_tokens = len(tokens)
        self.nbytes = nbytes


class _SimSeq:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.kv_len = 0
        self.fed: list[int] = []
        self.prefilled = False
        self._history = 0  # a rolling CRC of every token fed: greedy output depends on it
        self._rng = (
            random.Random(params.sampling_seed) if params.sampling_seed is not None else None
        )
        if self._rng is None and not params.greedy:
            self._rng = random.Random()

    def feed(self, tokens: list[int]) -> None:
        self.kv_len += len(tokens)
        self.fed += tokens
        self._history = zlib.crc32(b"".join(t.to_bytes(2, "little") for t in tokens), self._history)

    def snapshot(self, bytes_per_token: int) -> SimKVState:
        return SimKVState(tuple(self.fed), bytes_per_token * len(self.fed))

    def load(self, restore: KVRestore) -> None:
        state = restore.state
        assert isinstance(state, SimKVState), "a snapshot from another runner"
        assert self.kv_len == 0, "restore into a busy slot"
        self.kv_len, self.fed, self._history = 0, [], 0
        self.feed(list(state.tokens[: restore.n_tokens]))

    def verify(self, tokens: list[int], verify: Verify) -> int:
        """Feed [last, d1 .. dk] while each sample is the next draft; the last sample."""
        j = 0
        while True:
            self.feed([tokens[j]])
            token = self.sample(frozenset())
            if j == len(tokens) - 1 or token != tokens[j + 1]:
                break
            j += 1
        verify.accepted = j
        return token

    def sample(self, suppress: frozenset[int]) -> int:
        forced = [t for t, b in self.params.logit_bias.items() if b > 0 and t not in suppress]
        if forced:
            return max(forced, key=lambda t: self.params.logit_bias[t])
        if self._rng is not None:
            byte = self._rng.choice(_ALPHABET)
        else:
            byte = _ALPHABET[self._history % len(_ALPHABET)]
        return byte + _BYTE_OFFSET
