"""Step planning: what the runner computes next, for which sequences.

`StepPlanner.plan` turns the running sequences into one step's plan: one decode token per
decoding sequence, plus at most one prompt chunk of each prefilling sequence, up to
`max_prefill_tokens` in all; a speculating sequence's decode carries its drafts to verify
(engine/speculative.py). `plan_run` makes a plan of plain decodes a `DecodeRun`, for
runners that decode runs. `hold_burst` makes the requests admitted at one boundary a burst,
whose members decode only once all of them have their first tokens.

Planning changes only the planned sequences' bookkeeping (`prefilled`, `burst`, `leader`
and `forks`, and the KV reuse of the step); it sends no output. It runs in the scheduler's
task, once per step.
"""

from __future__ import annotations

import dataclasses

from ..config import EngineConfig
from ..runners.base import DecodeRun, SeqStep, Verify
from .kv_reuse import KVReuse
from .sequence import Sequence

__all__ = ["StepPlanner"]

_NOTHING: frozenset[int] = frozenset()

#: The longest run while a sequence that may draft is in it (it found no draft this step;
#: drafts are looked for again after the run): runs spare ordinary text a step per token,
#: and a draft found a few tokens later loses little.
SPEC_RUN_DECODES = 4


class StepPlanner:
    """The plans of one scheduler: its chunking, prefill budget, bursts and runs."""

    def __init__(
        self, config: EngineConfig, *, eos: frozenset[int], max_run: int, kv: KVReuse
    ) -> None:
        self.prefill_chunk = config.prefill_chunk_tokens
        self.prefill_budget = config.prefill_budget
        self.burst_tokens = config.burst_prefill_tokens
        #: Decodes a run may make at most (1: the runner decodes no runs).
        self.max_run = max_run
        self._eos = eos
        self._kv = kv
        #: Drafts are made only while at most this many sequences run (0: at any count).
        self.spec_batch_limit = config.speculative_disable_by_batch_size
        #: Whether the step being planned may draft (set by `plan`, read by `plan_run`).
        self._drafting = True

    def hold_burst(self, admitted: list[Sequence]) -> None:
        """Requests admitted together decode only once all of them have their first token,
        if their prompts hold at most `burst_tokens` tokens still to compute (forks compute
        none: their leader's prompt is theirs). No bursts when `burst_tokens` is 0."""
        if not self.burst_tokens:
            return
        remaining = sum(len(s.prompt_ids) - s.prefilled for s in admitted if s.leader is None)
        if remaining > self.burst_tokens:
            return
        # A fork of a leader admitted earlier waits for that leader's prefill, which the
        # limit did not count: it is no member, so nobody waits through it.
        ours = set(admitted)
        burst = {
            s for s in admitted if s.max_new_tokens > 0 and (s.leader is None or s.leader in ours)
        }
        if len(burst) > 1:
            for seq in burst:
                seq.burst = burst

    def plan(self, running: list[Sequence]) -> tuple[list[SeqStep], list[Sequence], list[Sequence]]:
        """The step's entries; the sequences that get a token, in plan order; and every
        sequence in the step."""
        plan: list[SeqStep] = []
        sampling: list[Sequence] = []
        stepped: list[Sequence] = []
        budget = self.prefill_budget
        forked: list[Sequence] = []
        first_tokens: list[tuple[int, Sequence]] = []  # (plan index, sequence)
        # A larger batch keeps the CPU busy already: drafts verified beside it cost more
        # decode work than they save (vLLM's disable_by_batch_size).
        limit = self.spec_batch_limit
        self._drafting = drafting = not limit or len(running) <= limit
        for seq in running:
            assert seq.slot is not None
            if seq.leader is not None:
                continue  # planned with its leader's last chunk
            prompt_len = len(seq.prompt_ids)
            # (A prompt restored whole is planned below, as a last chunk of no tokens.)
            if seq.prefilled == prompt_len and seq.pending_restore is None:  # decoding
                if seq.burst is not None:
                    if seq.burst:
                        continue  # held until the rest of its burst has a first token
                    seq.burst = None
                output_ids = seq.output_ids
                pos = prompt_len + len(output_ids) - 1
                suppress = self._suppress(seq)
                spec = seq.spec
                # Speculation: drafts to verify after the last token, leaving room for the
                # token sampled after them within max_new_tokens; none while suppressing.
                draft = (
                    spec.draft(prompt_len, output_ids, seq.max_new_tokens - len(output_ids) - 1)
                    if spec is not None and drafting and not suppress
                    else None
                )
                if draft:
                    entry = SeqStep(seq.slot, [output_ids[-1], *draft], pos, True, verify=Verify())
                else:
                    entry = SeqStep(seq.slot, [output_ids[-1]], pos, True, suppress, seq.hooks)
                plan.append(entry)
                sampling.append(seq)
                stepped.append(seq)
                continue
            # Chunks are cut at fixed multiples of prefill_chunk from the prompt's start,
            # never by what budget is left, so a prompt is computed in the same pieces
            # whatever else runs (the first prefilling sequence always fits).
            start = seq.prefilled
            end = min(prompt_len, (start // self.prefill_chunk + 1) * self.prefill_chunk)
            if end - start > budget:
                continue
            done = end == prompt_len
            sample = done and seq.max_new_tokens > 0
            targets, offset = self._prompt_targets(seq, start, end)
            plan.append(
                SeqStep(
                    seq.slot,
                    seq.prompt_ids[start:end],
                    start,
                    sample,
                    self._suppress(seq),
                    seq.hooks,
                    targets,
                    offset,
                    restore=self._kv.plan_restore(seq),
                    save=self._kv.plan_save(seq, end),
                )
            )
            seq.prefilled = end
            budget -= end - start
            stepped.append(seq)
            if done and seq.burst:
                seq.burst.discard(seq)
            if sample:
                first_tokens.append((len(plan) - 1, seq))
                sampling.append(seq)
                for fork in seq.forks:  # each samples from this chunk's logits, then decodes
                    assert fork.slot is not None
                    plan.append(
                        SeqStep(
                            fork.slot,
                            [],
                            prompt_len,
                            True,
                            self._suppress(fork),
                            fork.hooks,
                            fork_from=seq.slot,
                        )
                    )
                    fork.prefilled = fork.cached_tokens = prompt_len
                    if fork.burst:
                        fork.burst.discard(fork)
                    first_tokens.append((len(plan) - 1, fork))
                    stepped.append(fork)
                    sampling.append(fork)
                    forked.append(fork)
                seq.forks = []
        for fork in forked:  # (set only now: the loop above must skip them)
            fork.leader = None
        for i, seq in first_tokens:
            # A first token whose burst is still prefilling after this step is not decoded
            # next step: the runner must not decode it ahead either.
            if seq.burst:
                plan[i] = dataclasses.replace(plan[i], decode_ahead=False)
        return plan, sampling, stepped

    def plan_run(self, plan: list[SeqStep], sampling: list[Sequence]) -> DecodeRun | None:
        """A run for this plan if every entry is a plain decode; None for a single step.
        (Requests still waiting here wait for a slot: the run ends when one frees.)"""
        if self.max_run < 2 or len(plan) != len(sampling):
            return None
        limit = self.max_run
        watched = False
        stop_ids: list[frozenset[int]] = []
        for entry, seq in zip(plan, sampling, strict=True):
            if (
                entry.hooks is not None
                or entry.suppress
                or entry.verify is not None  # drafts to verify: a step of its own
                or not seq.output_ids  # a prompt's one-token last chunk, not a decode
                or seq.abort is not None
            ):
                return None
            # Each of its tokens up to its length is an ordinary token (length comes first).
            limit = min(limit, seq.max_new_tokens - len(seq.output_ids))
            if seq.spec is not None and self._drafting:
                # It found no draft this step: a short run, then it looks again.
                limit = min(limit, SPEC_RUN_DECODES)
            watched = watched or seq.watched
            params = seq.params
            stop_ids.append(_NOTHING if params.ignore_eos else self._eos | params.stop_token_ids)
        if limit < 2:
            return None
        return DecodeRun(limit=limit, stop_ids=stop_ids, wake_each=watched)

    @staticmethod
    def _prompt_targets(seq: Sequence, start: int, end: int) -> tuple[list[int] | None, int]:
        """Prompt logprobs for a chunk [start, end): the logits at position j score prompt
        token j + 1, for the positions from the request's logprob_start_len on (its first
        position has no logprob) up to the prompt's second-to-last (the last one's logits
        sample the first output token)."""
        if not seq.scores_prompt:
            return None, 0
        assert seq.hooks is not None and seq.hooks.logprobs is not None
        first = max(start, seq.hooks.logprobs.spec.start_len)
        last = min(end, len(seq.prompt_ids) - 1)  # exclusive
        if first >= last:
            return None, 0
        return seq.prompt_ids[first + 1 : last + 1], first - start

    def _suppress(self, seq: Sequence) -> frozenset[int]:
        """Before min_new_tokens, EOS and stop tokens may not be sampled (as SGLang's
        min-new-tokens penalizer does)."""
        params = seq.params
        if params.ignore_eos or len(seq.output_ids) >= params.min_new_tokens:
            return _NOTHING
        return self._eos | params.stop_token_ids
