"""Draft verification (speculative decoding, engine/speculative.py): the entries of a step
whose `tokens` are [last token, d1 .. dk] (`SeqStep.verify`).

Synopsis::

    rest = runner._verify_ahead(plan, entries, outputs, opened, sampled)  # in `_step_sync`
    runner._verify(plan, rest, sampled)  # one decode for them all, then accept

A verified entry is decoded with logits at every position, in one `llama_decode` with the
step's other verified entries; each position is sampled with the slot's own sampler chain, in
order, while the token sampled equals the next draft (llama.cpp's
`common_sampler_sample_and_accept_n`): the chain accepts exactly the tokens kept. The KV of
the rejected drafts is removed (`llama_memory_seq_rm`).

With `overlap_decode` the last token was usually decoded ahead already: position 0 is then
sampled from that decode's logits (`_verify_ahead`), as a plain decode would be, and only
when it equals d1 are d1 .. dk decoded; a draft rejected at its first token costs no decode.
`LlamaVerify` is a layer of `LlamaRunner`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llama_cpp

from ..base import SeqStep
from .decode_stop import DecodeStop
from .kv import LlamaKV
from .sampler import LlamaSampling

__all__ = ["LlamaVerify", "next_position"]


class LlamaVerify(LlamaSampling, LlamaKV):
    """Verification of drafted tokens (`VerifiesDrafts`)."""

    verifies_drafts = True
    _batch: Any
    _stop: DecodeStop

    def _verify_ahead(
        self,
        plan: Sequence[SeqStep],
        entries: list[int],
        outputs: dict[tuple[int, int, int], int],
        opened: set[int],
        sampled: dict[int, int],
    ) -> list[tuple[int, int]]:
        """Position 0 of each verified entry whose last token the decode ahead computed,
        sampled from its logits (before any other decode overwrites them): a token that is
        not d1 ends the entry there. Returns what is left to decode: (plan index, first
        position to decode), 0 for an entry not decoded ahead, 1 for one whose d1 was kept."""
        rest: list[tuple[int, int]] = []
        for i in entries:
            s = plan[i]
            idx = (
                None
                if s.seq_id in opened
                else outputs.pop((s.seq_id, s.tokens[0], s.start_pos), None)
            )
            if idx is None:
                rest.append((i, 0))
                continue
            token = self._sample(s, idx)
            if token == s.tokens[1]:
                rest.append((i, 1))
            else:
                sampled[i] = token  # no draft kept (`verify.accepted` stays 0)
        return rest

    def _verify(
        self, plan: Sequence[SeqStep], rest: list[tuple[int, int]], sampled: dict[int, int]
    ) -> None:
        """Decode the entries' tokens from their first position on, logits at each, in as few
        decodes as the batch allows, and accept their drafts."""
        rest = sorted(rest, key=lambda e: plan[e[0]].seq_id)  # llama.cpp wants ascending ids
        group: list[tuple[int, int]] = []
        size = 0
        for i, first in rest:
            n = len(plan[i].tokens) - first
            if group and size + n > self._max_step_tokens:
                self._verify_decode(plan, group, sampled)
                group, size = [], 0
            group.append((i, first))
            size += n
        if group:
            self._verify_decode(plan, group, sampled)

    def _verify_decode(
        self, plan: Sequence[SeqStep], group: list[tuple[int, int]], sampled: dict[int, int]
    ) -> None:
        batch = self._batch
        n = 0
        starts: list[int] = []  # batch index of each entry's first decoded position
        for i, first in group:
            s = plan[i]
            starts.append(n)
            for j in range(first, len(s.tokens)):
                batch.token[n] = s.tokens[j]
                batch.pos[n] = s.start_pos + j
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = s.seq_id
                batch.logits[n] = 1
                n += 1
        assert n <= self._max_step_tokens, "a decode larger than the context's batch"
        batch.n_tokens = n
        rc = llama_cpp.llama_decode(self._ctx, batch)
        if rc != 0:
            raise self._stop.failure(rc)
        for (i, first), start in zip(group, starts, strict=True):
            s = plan[i]
            tokens = s.tokens
            last = len(tokens) - 1
            j = first  # the position sampled: its token is kept while it equals tokens[j + 1]
            while True:
                token = self._sample(s, start + j - first)
                if j == last or token != tokens[j + 1]:
                    break
                j += 1
            assert s.verify is not None
            s.verify.accepted = j
            sampled[i] = token
            if j < last:  # the rejected drafts' cells
                llama_cpp.llama_memory_seq_rm(self._memory, s.seq_id, s.start_pos + j + 1, -1)


def next_position(s: SeqStep) -> int:
    """Where the token sampled for `s` goes: after its tokens, or after the drafts kept."""
    verify = s.verify
    return s.start_pos + (len(s.tokens) if verify is None else 1 + verify.accepted)
