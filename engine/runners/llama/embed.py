"""Embeddings in a llama.cpp context of their own, on the runner's loaded weights: a layer of
`LlamaRunner` (the `Embeds` protocol, engine/embeddings.py).

Synopsis::

    runner.embedding_model.pooling            # "last": from the GGUF, or --pooling
    vectors = await runner.embed([[1, 2], [3, 4, 5]])

The context is a second `llama_context` over the same `llama_model`, made at load when there is
a pooling type (so a failure is a start-up error; none is made without one), with the KV cache
type and offload of generation's context, KV for the longest input it embeds
(`--embedding-context-length`, at most the context length), and `embeddings` on and
llama.cpp's own pooling off: each decode hands back the hidden states (the final norm's
output, what llama.cpp pools) of the rows pooling needs, and they are pooled here: "last"
reads each input's last row, "cls" its first, "mean" sums them all. So a
causal model embeds an input longer than one decode in pieces, its KV carried between them,
and pools the whole input (llama.cpp pools each ubatch on its own: right for "last" only),
up to the rounding that prefilling in chunks brings. Generation's context, KV cache and
batches are never touched.

Which thread: every decode runs on the compute thread, as generation's do (a second thread
would start a second OpenMP team, and with more workers than cores every decode slows down,
docs/architecture.md). A decode carries at most one prompt chunk (`--chunked-prefill-size`)
of tokens and is one compute-thread job, so a generation step waits behind at most one such
decode, the pause a prompt chunk already causes; a run of decodes in progress is ended after
its current decode, so an embedding decode waits for one generation decode, not a whole run.
Short inputs share a decode, each its own sequence id; an input longer than a chunk is cut at
multiples of the chunk from its start and decoded alone; every decode that begins inputs
starts from an empty KV cache. So an input is computed the same whatever is embedded beside
it. One request embeds at a time (a Trio lock): the KV holds one decode's inputs. Each
decode is timed (`embed_decode_seconds`): the engine counts it as a step when it works out
how long an abort may wait. `stop_decoding` gives up the embedding decode in flight too (its
own `DecodeStop`), so closing never waits for it.
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np
import trio

from ...compute_thread import compute_thread
from ...config import EngineConfig
from ...embeddings import GGUF_POOLINGS, EmbeddingModel, Vector, embedding_cells
from ...errors import EngineClosed, RunnerFailure
from ...kv_memory import KV_DTYPES
from ..base import DecodeRun
from .decode_stop import DecodeStop, DecodeStopped
from .loading import MAX_GRAPH_TOKENS, model_meta

__all__ = ["LlamaEmbeddings", "declared_pooling"]

#: Inputs one decode of the embedding context holds (sequence ids).
EMBED_SEQS = 64

#: (input index, first position, end position): the tokens of one input in one decode.
_Piece = tuple[int, int, int]


def declared_pooling(model: Any) -> str | None:
    """The pooling type the GGUF declares (`<arch>.pooling_type`), None where it has none
    (a chat model) or declares "none"."""
    arch = model_meta(model, b"general.architecture") or ""
    value = model_meta(model, f"{arch}.pooling_type".encode())
    if value is None or not value.lstrip("-").isdigit():
        return None
    return GGUF_POOLINGS.get(int(value))


def _causal(model: Any) -> bool:
    """Whether attention is causal (an encoder such as BERT's is not: its input must be
    decoded whole, in one ubatch)."""
    arch = model_meta(model, b"general.architecture") or ""
    return (model_meta(model, f"{arch}.attention.causal".encode()) or "true") != "false"


class LlamaEmbeddings:
    """The embedding layer of `LlamaRunner`; `_init_embeddings` sets it up."""

    _model: ctypes.c_void_p
    _closed: bool
    #: The decode run on the compute thread now, if any (set by `LlamaRunner.decode_run`).
    _active_run: DecodeRun | None = None

    def _init_embeddings(self, config: EngineConfig, *, context: int, threads: int) -> None:
        declared = declared_pooling(self._model)
        pooling = config.pooling or declared
        if pooling == "rank":  # a reranker's scores are no embeddings
            pooling = None
        self._causal = _causal(self._model)
        cells = embedding_cells(config, context, pooling)
        # A causal model's input goes in pieces of one chunk; an encoder's whole, so its
        # longest input is one decode's worth. Never more than the cells: llama.cpp cuts a
        # causal context's batch to them (and a decode past its batch aborts the process).
        self._embed_batch_tokens = min(
            cells, config.prefill_chunk_tokens if self._causal else MAX_GRAPH_TOKENS
        )
        self._embedding_model = EmbeddingModel(
            dimensions=llama_cpp.llama_model_n_embd(self._model),
            pooling=pooling,
            pooling_source="--pooling" if config.pooling else "gguf",
            max_input_tokens=cells if self._causal else self._embed_batch_tokens,
        )
        self._embed_cells = cells if self._causal else self._embed_batch_tokens
        self._embed_lock = trio.Lock()
        #: Seconds the recent embedding decodes took (`TimesEmbedDecodes`).
        self.embed_decode_seconds: deque[float] = deque(maxlen=64)
        self._embed_ctx: Any = None
        self._embed_batch: Any = None
        self._embed_stop: DecodeStop | None = None
        if pooling is not None:
            self._create_embedding_context(config, threads)

    @property
    def embedding_model(self) -> EmbeddingModel:
        return self._embedding_model

    async def embed(self, inputs: Sequence[Sequence[int]]) -> list[Vector]:
        pooling = self._embedding_model.pooling
        assert pooling is not None, "checked by engine.embeddings.Embeddings"
        sums = [np.zeros(self._embedding_model.dimensions, np.float64) for _ in inputs]
        async with self._embed_lock:
            for pieces in self._embed_decodes(inputs):
                # `ComputeThread.run` waits for its decode when cancelled and returns, the
                # cancellation left pending: taken here, a client that left or a deadline
                # ends the request after the decode that ran, not after all of them.
                await trio.lowlevel.checkpoint_if_cancelled()
                if self._active_run is not None:
                    # A run of decodes is one compute-thread job of up to --max-run-decodes
                    # decodes: end it after its current decode (the runner may end a run
                    # early; the scheduler goes on with a step), so this decode waits for
                    # one generation decode, not a whole run.
                    self._active_run.stop()
                try:
                    await compute_thread().run(self._embed_decode, inputs, pieces, pooling, sums)
                except DecodeStopped:
                    # `stop_decoding`: the engine is closing, and it aborted this request
                    # first (`Embeddings.abort`): the checkpoint delivers that.
                    await trio.lowlevel.checkpoint()
                    raise EngineClosed("The engine is shutting down.") from None
        out = []
        for ids, total in zip(inputs, sums, strict=True):
            vector = total / len(ids) if pooling == "mean" else total
            norm = np.linalg.norm(vector)
            out.append((vector / norm if norm > 0 else vector).astype(np.float32))
        return out

    def _embed_decodes(self, inputs: Sequence[Sequence[int]]) -> list[list[_Piece]]:
        """The decodes that embed `inputs`: short ones together (at most `EMBED_SEQS`), a
        long one alone, in pieces cut at multiples of the batch size from its start (an
        encoder's inputs always fit one)."""
        size = self._embed_batch_tokens
        decodes: list[list[_Piece]] = []
        current: list[_Piece] = []
        used = 0
        for i, ids in enumerate(inputs):
            n = len(ids)
            if current and (n > size or used + n > size or len(current) == EMBED_SEQS):
                decodes.append(current)
                current, used = [], 0
            if n <= size:
                current.append((i, 0, n))
                used += n
            else:
                decodes.extend([(i, start, min(start + size, n))] for start in range(0, n, size))
        if current:
            decodes.append(current)
        return decodes

    def _embed_decode(
        self,
        inputs: Sequence[Sequence[int]],
        pieces: list[_Piece],
        pooling: str,
        sums: list[np.ndarray],
    ) -> None:
        """One decode of the embedding context (compute thread): the pieces' tokens, each
        input its own sequence id, then the rows pooling needs added into `sums`. A decode
        that begins its inputs starts from an empty KV cache, so an input's cells and what
        is computed for it do not depend on what was embedded before or beside it."""
        if self._closed:
            raise EngineClosed("The engine is shutting down.")
        ctx, stop = self._embed_ctx, self._embed_stop
        assert ctx is not None and stop is not None, "made at load when there is a pooling"
        memory = llama_cpp.llama_get_memory(ctx)
        if memory and pieces[0][1] == 0:  # not a long input's next piece (an encoder has none)
            llama_cpp.llama_memory_clear(memory, True)
        batch = self._embed_batch
        rows: list[tuple[int, int]] = []  # (batch row, input index)
        n = 0
        for seq, (index, start, end) in enumerate(pieces):
            ids = inputs[index]
            wanted_at = 0 if pooling == "cls" else len(ids) - 1
            for pos in range(start, end):
                batch.token[n] = ids[pos]
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                # Every row is an output: llama.cpp makes it so with embeddings on (and
                # says so on stderr when a row is not marked); pooling reads only some. It
                # also runs the output head on every row, marked or not and whatever its
                # pooling type (measured, 256 rows of SmolLM2: +15% time, +88 MiB of
                # output and compute buffers); this API has no way to skip it.
                batch.logits[n] = True
                if pooling == "mean" or pos == wanted_at:
                    rows.append((n, index))
                n += 1
        batch.n_tokens = n
        began = time.perf_counter()
        status = llama_cpp.llama_decode(ctx, batch)
        self.embed_decode_seconds.append(time.perf_counter() - began)
        if status != 0:
            raise stop.failure(status)
        width = self._embedding_model.dimensions
        for row, index in rows:
            pointer = llama_cpp.llama_get_embeddings_ith(ctx, row)
            if not pointer:
                raise RunnerFailure("llama.cpp returned no embedding for a row it computed")
            sums[index] += np.ctypeslib.as_array(pointer, shape=(width,))

    def _create_embedding_context(self, config: EngineConfig, threads: int) -> None:
        """The embedding context (at load, on the compute thread): KV for the longest input
        (one long input, or one decode of up to `EMBED_SEQS` short ones), of generation's
        cache type and offload, and decodes of at most one batch of tokens, never cut by
        llama.cpp. RunnerFailure where llama.cpp cannot make it (a start-up error)."""
        dtype = KV_DTYPES[config.kv_cache_dtype]
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self._embed_cells
        params.n_batch = params.n_ubatch = self._embed_batch_tokens
        params.n_seq_max = EMBED_SEQS
        params.kv_unified = True
        params.embeddings = True
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE  # pooled here, per input
        params.n_threads = params.n_threads_batch = threads
        params.offload_kqv = config.kv_offload
        params.type_k = params.type_v = dtype.ggml_type
        if dtype.quantized:  # llama.cpp's quantized V cache needs flash attention (loading.py)
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not ctx:
            raise RunnerFailure(
                "llama.cpp could not create the embedding context "
                f"({self._embed_cells} cells, --embedding-context-length)"
            )
        self._embed_ctx = ctx
        self._embed_stop = DecodeStop(ctx)
        self._embed_batch = llama_cpp.llama_batch_init(self._embed_batch_tokens, 0, 1)

    def _stop_embedding(self) -> None:
        """Give up the embedding decode in flight, and every later one (any thread)."""
        if self._embed_stop is not None:
            self._embed_stop.set()

    def _close_embeddings(self) -> None:
        """Free the embedding context (before the model; the compute thread is idle)."""
        if self._embed_batch is not None:
            llama_cpp.llama_batch_free(self._embed_batch)
            self._embed_batch = None
        if self._embed_ctx is not None:
            llama_cpp.llama_free(self._embed_ctx)
            self._embed_ctx = None
        if self._embed_stop is not None:
            self._embed_stop.release()
