"""`LlamaRunner`, the facade the scheduler calls (`Runner` in engine/runners/base.py): loading,
slots opened and closed, steps and runs handed to the compute thread, and closing.

Synopsis::

    runner = await compute_thread().run(LlamaRunner.load, config, orphan=LlamaRunner.close)
    runner.open_sequence(0, params)
    prompt = runner.tokenize("Hi", add_special=True)
    tokens = await runner.step([SeqStep(0, prompt, 0, sample=True)])
    runner.close_sequence(0)
    runner.close()  # blocking: behind any decode still queued

Its state lives on this one object; the methods that work on it are grouped by job in the
classes it is made of (vocabulary.py, kv.py, sampler.py, step.py, decode_run.py). `step` and
`decode_run` wait for the compute thread even when cancelled (`ComputeThread.run`): the
model is never freed under a running decode.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import llama_cpp
import trio

from ...compute_thread import compute_thread
from ...config import EngineConfig
from ...embeddings import embedding_cells
from ...grammar import Grammars
from ...kv_memory import KV_DTYPES, InsufficientMemory, check_memory, describe_bytes, mem_available
from ...models import named_model, resolve_model_path
from ...placement import Placement
from ...repack import WeightsRepack
from ...request import ModelInfo
from ...sampling import SamplingParams
from ..base import DecodeRun, RunFeed, SeqStep, nothing_decoded
from ..hugepages import HugePages
from .decode_run import LlamaDecodeRuns
from .decode_stop import DecodeStop, DecodeStopped
from .devices import plan_for
from .embed import LlamaEmbeddings, declared_pooling
from .loading import (
    batch_tokens,
    graph_tokens,
    kv_bytes_per_cell,
    load_weights,
    log_loaded,
    mapped_weights,
    model_meta,
    new_context,
)
from .sampler import penalized
from .vocabulary import LlamaVocabulary, lltokenizer, special_tokens

__all__ = ["LlamaRunner"]

LOGGER = logging.getLogger("tributary.engine.llama")


class LlamaRunner(LlamaVocabulary, LlamaDecodeRuns, LlamaEmbeddings):
    """Create with `LlamaRunner.load(config)`; the scheduler is its only caller."""

    @classmethod
    def load(cls, config: EngineConfig) -> LlamaRunner:
        """Load the model and create the context. Blocking (call it in a thread)."""
        path = resolve_model_path(config.model_path)  # a registered name or a file
        # Read before loading: the memory the weights then take counts as available, and what
        # they and the KV cache need is checked against that.
        available = mem_available()
        # Where the layers go is decided before loading (devices' memory checked there);
        # what stays in host memory is checked against `available`.
        placement = plan_for(path, config)
        size = placement.host_weight_bytes if placement.offloaded else path.stat().st_size
        if not mapped_weights(config) and available is not None and size > available:
            # Read, the weights take their size in memory of the process's own at once.
            raise InsufficientMemory(
                f"not enough memory: the model file ({describe_bytes(size)}) is larger than "
                f"the {describe_bytes(available)} available"
            )
        loaded = load_weights(path, config, placement)
        model = loaded.model
        try:
            return cls(
                model,
                path,
                config,
                available=available,
                huge_pages=loaded.pages,
                placement=placement,
                weights_repack=loaded.repack,
            )
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
        placement: Placement | None = None,
        weights_repack: WeightsRepack | None = None,
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
        self.kv_bytes = self.kv_cells * kv_bytes_per_cell(model, dtype.bytes_per_element)
        #: Bytes of the embedding context's KV (0: it has none, there being no pooling type).
        self.embedding_kv_bytes = embedding_cells(
            config, context, config.pooling or declared_pooling(model)
        ) * kv_bytes_per_cell(model, dtype.bytes_per_element)
        model_bytes = llama_cpp.llama_model_size(model)
        on_gpu = placement if placement is not None and placement.offloaded else None
        check_memory(  # what host memory holds: on a GPU, the planning checked the device's
            model_bytes=on_gpu.host_weight_bytes if on_gpu else model_bytes,
            kv_bytes=on_gpu.host_kv_bytes if on_gpu else self.kv_bytes + self.embedding_kv_bytes,
            embedding_kv_bytes=self.embedding_kv_bytes,
            prefix_cache_bytes=config.prefix_cache_bytes,
            available=available,
            config=config,
            context_length=context,
        )
        self._graph_tokens = graph_tokens(config)
        self._max_step_tokens = batch_tokens(config)
        threads = config.threads or os.cpu_count() or 1
        self._ctx = ctx = new_context(
            model, config, kv_cells=self.kv_cells, n_batch=self._max_step_tokens, threads=threads
        )
        self._stop = DecodeStop(ctx)
        self._memory = llama_cpp.llama_get_memory(ctx)
        self._batch = llama_cpp.llama_batch_init(self._max_step_tokens, 0, 1)

        self._samplers = {}
        #: Slots whose chain is greedy alone (no logit bias, no penalties): their token is the
        #: row's argmax, read with numpy (see `_sample`).
        self._argmax = set()
        self._row_views = {}
        self._pieces = {}
        #: KV cells per slot (on the compute thread: recounted from llama.cpp after a step,
        #: set from the position after a decode launched ahead).
        self._slot_cells = {}
        #: Slots released by the scheduler whose KV the compute thread has not removed yet.
        self._freeing = set()
        self._overlap = config.overlap_decode
        #: The decode launched ahead for the next step (compute thread only).
        self._ahead = None
        #: Slots opened since the last step began: a decode launched ahead for the slot's
        #: previous sequence must never be taken for the new one's.
        self._opened = set()
        self._closed = False
        self.grammars = Grammars(lltokenizer(self._vocab, n_vocab), n_vocab)
        self._init_embeddings(config, context=context, threads=threads)
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
            chat_template=config.chat_template
            or self._meta_str(b"tokenizer.chat_template")
            or _named_template(config),
            placement=placement,
            weights_repack=weights_repack,
        )
        #: Sliding-window attention: the positions its layers attend to, which is all that
        #: llama.cpp keeps of them in a snapshot (`ReusesKV`); None for a model without.
        self.kv_window = llama_cpp.llama_model_n_swa(model) or None
        if self.kv_window and dtype.quantized:
            # A quantized V cache needs flash attention, under which a restored snapshot
            # longer than the window does not decode what a prefill does (loading.py).
            self.reuses_kv = False
            LOGGER.warning(
                "prefix cache and forked samples are off: this model's sliding-window "
                "attention with a %s KV cache cannot restore a prompt's KV exactly; "
                "--kv-cache-dtype f16 turns them on",
                config.kv_cache_dtype,
            )
        log_loaded(
            path,
            config,
            model_bytes=model_bytes,
            context=context,
            threads=threads,
            kv_bytes=self.kv_bytes,
            huge_pages=huge_pages,
            placement=placement,
        )

    # -- sequences ----------------------------------------------------------------------

    def open_sequence(self, seq_id: int, params: SamplingParams) -> None:
        assert seq_id not in self._samplers, f"slot {seq_id} is busy"
        self._samplers[seq_id] = self._sampler_chain(params)
        if params.greedy and not params.logit_bias and not penalized(params):
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

    # -- steps --------------------------------------------------------------------------

    async def step(self, plan: Sequence[SeqStep]) -> list[int]:
        try:
            return await compute_thread().run(self._step_sync, plan)
        except DecodeStopped:
            await _stopped()
            raise

    #: Takes `decode_run` (engine/runners/base.py, `DecodeRun`).
    decodes_runs = True

    async def decode_run(self, plan: Sequence[SeqStep], run: DecodeRun, feed: RunFeed) -> None:
        """The whole run is one job on the compute thread: it decodes again as soon as a
        decode's tokens are sampled and handed over, and the event loop wakes only when the
        run says so (`run.wake_each`) or when it ends."""

        def expose(feed_published: Callable[[], None]) -> None:
            run.feed_decoded = feed_published

        self._active_run = run  # an embedding decode ends it early (embed.py)
        try:
            await compute_thread().run(
                self._run_sync, plan, run, feed=feed, interrupt=run.stop, published=expose
            )
        except DecodeStopped:
            await _stopped()
            raise
        finally:
            run.feed_decoded = nothing_decoded
            self._active_run = None

    def stop_decoding(self) -> None:
        """Give up the decode running now, and every later one, at llama.cpp's next graph
        node (`StopsDecoding`): the engine is closing and its requests all end with it. From
        any thread; after it, the runner is only fit for `close`."""
        self._stop.set()
        self._stop_embedding()

    def close(self) -> None:
        if self._closed:
            return
        # Behind any decode launched ahead, given up at once: the model is never freed under
        # a running decode.
        self._stop.set()
        self._stop_embedding()
        try:
            compute_thread().wait_idle()
            self._closed = True
            for chain in self._samplers.values():
                llama_cpp.llama_sampler_free(chain)
            self._samplers.clear()
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
            self._close_embeddings()
            llama_cpp.llama_model_free(self._model)
        finally:
            self._stop.release()  # llama.cpp's errors are shown again, whatever happened

    def _meta_str(self, key: bytes) -> str | None:
        return model_meta(self._model, key)


async def _stopped() -> None:
    # `stop_decoding` comes with the cancellation of the engine's scheduler, which this
    # checkpoint delivers: the requests of the step or run then end as the engine's exit
    # ends them (a 503 abort), not as a failed step. Without one, DecodeStopped is raised.
    await trio.lowlevel.checkpoint()


def _named_template(config: EngineConfig) -> str | None:
    """The chat template a registered model is served with when its GGUF has none."""
    model = named_model(config.model_path)
    return model.chat_template if model is not None else None


def _token_or_none(token: int) -> int | None:
    return token if token >= 0 else None
