"""A slot's KV cache: snapshots in host memory and back (prefix cache, forks), sampling from
a saved logits row, and the count of cells each slot holds.

Synopsis::

    state = runner._snapshot(seq_id)  # LlamaKVState, on the compute thread
    runner._load(other_seq_id, KVRestore(state, state.n_tokens, logits_row))
    token = runner._sample_restored(seq_step)  # a whole prompt restored: no decode

All but `kv_used_cells` run on the compute thread only. `kv_used_cells` may be called from
the event loop while a decode runs: it reads the count the last job left, never llama.cpp.
`LlamaKV` is a layer of `LlamaRunner`, which sets `_ctx`, `_memory`, `_slot_cells` and
`_freeing` when it loads.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterable
from typing import Any

import llama_cpp
import numpy as np

from ...errors import RunnerFailure
from ..base import KVRestore, SeqStep

__all__ = ["LlamaKV", "LlamaKVState"]

#: `llama_token_data` (id, logit, p), for a candidate array made with numpy.
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


class LlamaKVState:
    """One slot's KV as `llama_state_seq_get_data` wrote it (positions 0 .. n_tokens - 1)."""

    __slots__ = ("data", "n_tokens")

    def __init__(self, data: np.ndarray, n_tokens: int) -> None:
        self.data = data
        self.n_tokens = n_tokens

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class LlamaKV:
    """Snapshot, restore and count the KV cells of slots."""

    _ctx: Any
    _memory: Any
    _slot_cells: dict[int, int]
    _freeing: set[int]
    _n_vocab: int
    _samplers: dict[int, ctypes.c_void_p]
    _argmax: set[int]

    def _snapshot(self, seq_id: int) -> LlamaKVState:
        """The slot's KV in host memory (compute thread only)."""
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq_id)
        data = np.empty(size, dtype=np.uint8)  # np.empty: no pass to zero it first
        ptr = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_seq_get_data(self._ctx, ptr, size, seq_id) != size:
            raise RunnerFailure(f"llama_state_seq_get_data failed for slot {seq_id}")
        n_tokens = llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id) + 1
        return LlamaKVState(data, n_tokens)

    def _load(self, seq_id: int, restore: KVRestore) -> None:
        """Put a snapshot into an empty slot, keeping its first `restore.n_tokens` positions
        (compute thread only). A failure leaves the slot empty and fails the step."""
        state = restore.state
        assert isinstance(state, LlamaKVState), "a snapshot from another runner"
        ptr = state.data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_seq_set_data(self._ctx, ptr, state.nbytes, seq_id) == 0:
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
            raise RunnerFailure(f"llama_state_seq_set_data failed for slot {seq_id}")
        if restore.n_tokens < state.n_tokens:
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, restore.n_tokens, -1)

    def _sample_restored(self, s: SeqStep) -> int:
        """Sample `s`'s first token from the logits row saved with the whole prompt it
        restored, as `_sample` would from the row a cold prefill leaves: suppression and
        hooks on a copy, then the slot's chain over the same candidates that
        `llama_sampler_sample` builds (every token, in id order, p = 0), and the token
        accepted (compute thread only)."""
        assert s.restore is not None and s.restore.logits is not None, "no saved logits"
        row = s.restore.logits.copy()
        for token in s.suppress:
            if 0 <= token < self._n_vocab:
                row[token] = -math.inf
        if s.hooks is None and s.seq_id in self._argmax:
            return int(np.argmax(row))
        if s.hooks is not None:
            s.hooks.prepare(row)
        cur = np.zeros(self._n_vocab, dtype=_TOKEN_DATA)
        cur["id"] = np.arange(self._n_vocab, dtype=np.int32)
        cur["logit"] = row[: self._n_vocab]
        candidates = llama_cpp.llama_token_data_array(
            data=cur.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
            size=self._n_vocab,
            selected=-1,
            sorted=False,
        )
        chain = self._samplers[s.seq_id]
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(candidates))
        assert 0 <= candidates.selected < self._n_vocab, "the sampler selected nothing"
        token = int(cur["id"][candidates.selected])
        llama_cpp.llama_sampler_accept(chain, token)
        if s.hooks is not None:
            s.hooks.sampled(row, token)
        return token

    def kv_used_cells(self) -> int:
        # The count after the last job, less the slots released since (their removal is
        # queued behind at most one decode).
        cells = self._slot_cells
        return sum(n for slot, n in list(cells.items()) if slot not in self._freeing)

    def _count_kv(self, seq_ids: Iterable[int] | None = None) -> None:
        """Refresh the per-slot KV counts from llama.cpp (compute thread only): of `seq_ids`,
        or of every slot. A step refreshes only the slots it computed (not those whose token
        was decoded ahead: `_decode_ahead` counts them): a call per slot across the
        ctypes boundary is not worth spending between one decode and the next."""
        cells = dict(self._slot_cells)
        for seq_id in range(llama_cpp.llama_n_seq_max(self._ctx)) if seq_ids is None else seq_ids:
            hi = llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id)
            if hi >= 0:
                # Positions 0..hi: every sequence starts at 0. (Not hi - pos_min + 1: with
                # sliding-window attention llama.cpp's pos_min is the window's first position,
                # while the other layers hold them all.)
                cells[seq_id] = hi + 1
            else:
                cells.pop(seq_id, None)
        self._slot_cells = cells
