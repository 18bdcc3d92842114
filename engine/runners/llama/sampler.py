"""Sampling: one llama.cpp sampler chain per slot, in SGLang's order, and the logits it
samples from, as zero-copy numpy views of llama.cpp's output buffer.

Synopsis::

    chain = runner._sampler_chain(params)  # one per open slot, freed when it closes
    token = runner._sample(seq_step, batch_index)  # after a decode, on the compute thread

A greedy chain with no bias and no penalty is skipped: its token is the row's argmax, read
with numpy. A view of the logits is valid until the next decode overwrites them.
`LlamaSampling` is a layer of `LlamaRunner`, which sets its attributes when it loads.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import llama_cpp
import numpy as np

from ...sampling import SamplingParams
from ..base import SeqStep

__all__ = ["LlamaSampling", "penalized"]


class LlamaSampling:
    """Sampler chains and logits rows."""

    _ctx: Any
    _n_vocab: int
    _context: int
    _max_step_tokens: int
    _samplers: dict[int, ctypes.c_void_p]
    _argmax: set[int]
    _row_views: dict[int, np.ndarray]

    def _sampler_chain(self, p: SamplingParams) -> ctypes.c_void_p:
        lib = llama_cpp
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if p.logit_bias:
            biases = (lib.llama_logit_bias * len(p.logit_bias))()
            for i, (token, bias) in enumerate(p.logit_bias.items()):
                biases[i].token = token  # type: ignore[assignment]
                biases[i].bias = bias
            lib.llama_sampler_chain_add(
                chain, lib.llama_sampler_init_logit_bias(self._n_vocab, len(p.logit_bias), biases)
            )
        if penalized(p):
            lib.llama_sampler_chain_add(
                chain,
                lib.llama_sampler_init_penalties(
                    self._n_vocab,
                    self._context,  # every generated token counts
                    p.repetition_penalty,
                    p.frequency_penalty,
                    p.presence_penalty,
                ),
            )
        if p.greedy:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return chain
        # SGLang's order, not llama.cpp's usual one: scale by temperature first, then cut
        # with top-k / top-p / min-p on the scaled probabilities.
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(p.temperature))
        if p.top_k < self._n_vocab:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(p.top_k))
        if p.top_p < 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(p.min_p, 1))
        # llama.cpp seeds are 32-bit, and LLAMA_DEFAULT_SEED (2**32 - 1) means "random": fold
        # any integer into [0, 2**32 - 2] so every seed stays reproducible.
        seed = lib.LLAMA_DEFAULT_SEED if p.sampling_seed is None else p.sampling_seed % 0xFFFFFFFF
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed))
        return chain

    def _sample(self, s: SeqStep, idx: int) -> int:
        """Sample `s`'s next token from the logits of batch index `idx`."""
        if s.suppress:
            logits = llama_cpp.llama_get_logits_ith(self._ctx, idx)
            for token in s.suppress:
                if 0 <= token < self._n_vocab:  # never write outside the row
                    logits[token] = -math.inf
        chain = self._samplers[s.seq_id]
        if s.hooks is None:
            if s.seq_id in self._argmax:
                # What the greedy sampler picks (the first highest logit), without building
                # llama.cpp's candidate array over the whole vocabulary: 0.1 ms a token on
                # the compute thread, between one decode and the next.
                return int(np.argmax(self._row(idx)))
            return int(llama_cpp.llama_sampler_sample(chain, self._ctx, idx))
        row = self._row(idx)
        s.hooks.prepare(row)
        token = int(llama_cpp.llama_sampler_sample(chain, self._ctx, idx))
        s.hooks.sampled(row, token)
        return token

    def _rows(self, first: int, count: int) -> np.ndarray:
        """The logits of `count` consecutive outputs from batch index `first`, as a writable
        float32 view of llama.cpp's output buffer (no copy): a sequence's outputs are
        consecutive rows there."""
        if count == 1:
            return self._row(first)[np.newaxis]
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, first)
        rows = np.ctypeslib.as_array(ptr, shape=(count, self._n_vocab))
        last = llama_cpp.llama_get_logits_ith(self._ctx, first + count - 1)
        step = self._n_vocab * ctypes.sizeof(ctypes.c_float)
        assert (
            ctypes.addressof(last.contents) - ctypes.addressof(ptr.contents) == (count - 1) * step
        ), "llama.cpp's output rows are not consecutive"
        return rows

    def _row(self, idx: int) -> np.ndarray:
        """The logits of batch index `idx`, as a writable float32 view kept per address:
        made once, not per token (`np.ctypeslib.as_array` runs enough Python to cost 50-60
        µs right after a decode has swept the caches). A view is only looked up by the
        address llama.cpp has just returned for current logits, so a view made for an
        output buffer since reallocated is never read unless a new row sits at that very
        address."""
        address = ctypes.addressof(llama_cpp.llama_get_logits_ith(self._ctx, idx).contents)
        row = self._row_views.get(address)
        if row is None:
            if len(self._row_views) >= 4 * self._max_step_tokens:
                self._row_views.clear()  # an output buffer was reallocated: forget the old
            buffer: Any = (ctypes.c_float * self._n_vocab).from_address(address)  # for numpy
            row = self._row_views[address] = np.frombuffer(buffer, dtype=np.float32)
        return row


def penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty or p.presence_penalty)
