"""A step on the compute thread: the decodes of one `Runner.step`, and the decode launched
ahead of the next one.

Synopsis::

    tokens = runner._step_sync(plan)  # on the compute thread; one token per sampled entry

A step decodes all single-token entries in one call, then its prompt chunks, those of one
length together; it scores prompt positions, snapshots and forks slots as the plan asks.
With `overlap_decode`, it then queues a decode of the tokens it sampled (`_decode_ahead`),
which runs while the event loop commits the step; the next step samples from its logits
instead of decoding those entries again. A failed decode raises RunnerFailure and fails the
step (a decode ahead that fails is dropped: the step decodes its entries itself); one given
up because the engine is closing raises DecodeStopped (decode_stop.py).
`LlamaSteps` is a layer of `LlamaRunner`, which sets its attributes when it loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llama_cpp

from ...compute_thread import compute_thread
from ...request import ModelInfo
from ..base import KVRestore, SeqStep
from .decode_stop import DecodeStop
from .verify import LlamaVerify, next_position

__all__ = ["DecodeAhead", "LlamaSteps", "batch_fields"]


class LlamaSteps(LlamaVerify):
    """Steps, and the decode launched ahead of the next one."""

    info: ModelInfo
    _batch: Any
    _graph_tokens: int
    _overlap: bool
    _ahead: DecodeAhead | None
    _opened: set[int]
    _closed: bool
    _stop: DecodeStop

    def _step_sync(self, plan: Sequence[SeqStep], *, launch_ahead: bool = True) -> list[int]:
        """One decode for all single-token entries, then the prompt chunks: those of one
        length together, up to `graph_tokens` prompt tokens a decode.

        Prompt chunks share a graph only with chunks of the same length, so that no chunk's
        shape depends on what else runs: with one KV stream per sequence, llama.cpp splits a
        batch into ubatches holding the same number of tokens of each sequence, and a chunk
        split differently is computed (very slightly) differently, which is enough to change
        greedy output (measured: 1 of 4 long prompts, behind another prompt). Chunks of equal
        length are never split, and each one's logits come out bit for bit as they do alone
        (measured on 16 random 60-token prompts, in groups of 1, 4, 8 and 16); one graph for
        a burst of them is 6-10% faster than a decode each, as llama-server batches them.
        """
        sampled: dict[int, int] = {}  # plan index -> token
        # Slots whose KV this step changes (their cells are recounted): all but those whose
        # token was decoded ahead, counted when that decode ran.
        touched = {s.seq_id for s in plan}
        singles = [i for i, s in enumerate(plan) if len(s.tokens) == 1]
        verifying = [i for i, s in enumerate(plan) if s.verify is not None]
        rest = [(i, 0) for i in verifying]  # verified entries still to decode (verify.py)
        ahead, self._ahead = self._ahead, None
        opened, self._opened = self._opened, set()
        if ahead is not None:
            # Entries the decode launched ahead already computed are sampled from its logits
            # (still in llama.cpp's output buffer: nothing has decoded since), before any
            # other decode overwrites them.
            outputs = ahead.outputs
            missed: list[int] = []
            for i in singles:
                s = plan[i]
                idx = None if s.seq_id in opened else outputs.pop(_key(s), None)
                if idx is None:
                    missed.append(i)
                else:
                    sampled[i] = self._sample(s, idx)
                    touched.discard(s.seq_id)
            singles = missed
            if verifying:
                rest = self._verify_ahead(plan, verifying, outputs, opened, sampled)
            # Computed for nobody (its sequence ended or was aborted): drop the cell. A slot
            # released since had all its cells removed by the free job that ran in between,
            # and a sequence newly given that slot has no cells before this step's prefill.
            for seq_id, _token, pos in ahead.outputs:
                if seq_id not in self._freeing:
                    llama_cpp.llama_memory_seq_rm(self._memory, seq_id, pos, -1)
                    touched.add(seq_id)
        forks: dict[int, list[int]] = {}  # leader slot -> plan indexes of its forks
        chunks: dict[int, list[int]] = {}  # prompt chunk length -> plan indexes
        for i, s in enumerate(plan):
            if s.restore is not None:  # after that clean-up, which may touch a reopened slot
                self._load(s.seq_id, s.restore)
                if s.sample and not s.tokens and s.fork_from is None:  # a whole prompt
                    sampled[i] = self._sample_restored(s)
            if s.fork_from is not None:
                forks.setdefault(s.fork_from, []).append(i)
            if len(s.tokens) > 1 and s.verify is None:
                chunks.setdefault(len(s.tokens), []).append(i)
        if singles:
            self._decode(plan, singles, sampled, forks)
        if rest:
            self._verify(plan, rest, sampled)
        for length, members in chunks.items():
            # In slot order, so that each decode covers a run of consecutive slots when it can
            # (llama.cpp cuts a call at every gap in the sequence ids).
            members.sort(key=lambda i: plan[i].seq_id)
            per_decode = self._graph_tokens // length
            for k in range(0, len(members), per_decode):
                self._decode(plan, members[k : k + per_decode], sampled, forks)
        nxt: list[tuple[int, int, int]] = []
        if launch_ahead and self._overlap and sampled:
            # Every sequence that got a token will decode it next step unless it finishes:
            # start that decode now, so llama.cpp's threads never wait for the event loop.
            # (An end-of-generation token usually finishes its sequence: not worth decoding.)
            eog = self.info.eos_token_ids
            nxt = [
                (plan[i].seq_id, t, next_position(plan[i]))
                for i, t in sampled.items()
                if t not in eog and plan[i].decode_ahead
            ]
        if touched:
            self._count_kv(touched)
        if nxt:
            compute_thread().submit(self._decode_ahead, nxt)
        return [sampled[i] for i in sorted(sampled)]

    def _decode_ahead(self, entries: list[tuple[int, int, int]]) -> None:
        """Decode (seq_id, token, pos) entries for the step the scheduler is about to plan.
        Runs on the compute thread right after a step, while the event loop commits it."""
        # A slot closed since the step that asked for this (a run's last tokens reach the
        # event loop before this job is queued, and its request may end meanwhile), or
        # given to another sequence since, is not decoded.
        samplers, freeing, opened = self._samplers, self._freeing, self._opened
        entries = [e for e in entries if e[0] in samplers and e[0] not in freeing | opened]
        if not entries or self._closed or self._stop.is_set:
            return
        batch = self._batch
        tokens, positions, n_seq_ids, seq_ids, logits = batch_fields(batch)
        outputs: dict[tuple[int, int, int], int] = {}
        for n, entry in enumerate(sorted(entries)):
            seq_id, tokens[n], positions[n] = entry
            n_seq_ids[n] = 1
            seq_ids[n][0] = seq_id
            logits[n] = 1
            outputs[entry] = n
        batch.n_tokens = len(entries)
        if llama_cpp.llama_decode(self._ctx, batch) != 0:
            for seq_id, _token, pos in entries:  # the step will decode them itself
                llama_cpp.llama_memory_seq_rm(self._memory, seq_id, pos, -1)
            return
        self._ahead = DecodeAhead(outputs)
        # Each slot now ends at `pos`: its cells are 0..pos, as every sequence starts at
        # position 0 (prompts, restored prefixes and forks alike). Counted here, not with
        # two ctypes calls per slot between this decode and the next.
        cells = dict(self._slot_cells)
        for seq_id, _token, pos in entries:
            cells[seq_id] = pos + 1
        self._slot_cells = cells

    def _decode(
        self,
        plan: Sequence[SeqStep],
        members: list[int],
        sampled: dict[int, int],
        forks: dict[int, list[int]],
    ) -> None:
        batch = self._batch
        n = 0
        outputs: list[tuple[int, int]] = []  # (plan index, batch index)
        scored: list[tuple[int, int]] = []  # (plan index, batch index of the first scored row)
        # With one KV stream per sequence, llama.cpp cuts a batch into separate graphs at
        # every break in ascending, consecutive sequence ids; so the batch goes in id order.
        for i in sorted(members, key=lambda i: plan[i].seq_id):
            s = plan[i]
            first = n
            for j, token in enumerate(s.tokens):
                batch.token[n] = token
                batch.pos[n] = s.start_pos + j
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = s.seq_id
                batch.logits[n] = 0
                n += 1
            if s.prompt_targets:
                # Prompt logprobs need the logits of every scored position, not only the last.
                lo = first + s.prompt_offset
                for k in range(lo, lo + len(s.prompt_targets)):
                    batch.logits[k] = 1
                scored.append((i, lo))
            if s.sample:
                batch.logits[n - 1] = 1
                outputs.append((i, n - 1))
        assert n <= self._max_step_tokens, "a decode larger than the context's batch"
        batch.n_tokens = n
        rc = llama_cpp.llama_decode(self._ctx, batch)
        if rc != 0:
            raise self._stop.failure(rc)
        for i, lo in scored:
            s = plan[i]
            assert s.hooks is not None and s.prompt_targets is not None
            s.hooks.score_prompt(self._rows(lo, len(s.prompt_targets)), s.prompt_targets)
        for i, idx in outputs:
            followers = forks.get(plan[i].seq_id, [])
            # Suppression and hooks write into the row: each fork samples from the row as
            # the decode left it, so it draws exactly what its own prefill would have given.
            save = plan[i].save
            keep = save is not None and save.with_logits  # (a whole prompt's, for the cache)
            row = self._row(idx).copy() if followers or keep else None
            if save is not None and keep:
                save.logits = row  # (never written to: forks copy it into the buffer)
            sampled[i] = self._sample(plan[i], idx)
            for f in followers:
                self._row(idx)[:] = row
                sampled[f] = self._sample(plan[f], idx)
        for i in members:
            s = plan[i]
            followers = forks.get(s.seq_id, [])
            if s.save is None and not followers:
                continue
            state = self._snapshot(s.seq_id)
            if s.save is not None:
                s.save.state = state
            for f in followers:
                self._load(plan[f].seq_id, KVRestore(state, state.n_tokens))


class DecodeAhead:
    """A decode launched before the scheduler asked for it: batch index per entry."""

    __slots__ = ("outputs",)

    def __init__(self, outputs: dict[tuple[int, int, int], int]) -> None:
        self.outputs = outputs


def batch_fields(batch: Any) -> tuple[Any, Any, Any, Any, Any]:
    """A `llama_batch`'s token, pos, n_seq_id, seq_id and logits arrays. Each read of a
    pointer field builds a ctypes object: read each once per decode, not per entry."""
    return batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits


def _key(s: SeqStep) -> tuple[int, int, int]:
    return (s.seq_id, s.tokens[0], s.start_pos)
