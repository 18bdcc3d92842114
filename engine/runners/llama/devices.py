"""Where the llama runner puts a model: the GPU devices llama.cpp sees, the model's layer
sizes read from its GGUF before loading, and the plan (engine/placement.py) turned into
llama.cpp's model parameters.

Synopsis::

    placement = plan_for(path, config)  # before loading: llama.cpp needs n_gpu_layers then
    place(model_params, placement, config)  # n_gpu_layers, main_gpu, split_mode, tensor_split

A CPU-only llama.cpp build (`llama_supports_gpu_offload()` false) has no devices: every layer
stays in host memory whatever the flags say, and flags that ask for a GPU get one WARNING, as
llama-server warns and ignores them. llama.cpp's own default (`llama_model_default_params`)
would offload every layer of a GPU build; `place` always sets the planned number.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

import llama_cpp

from ...config import EngineConfig
from ...embeddings import GGUF_POOLINGS, embedding_cells
from ...kv_memory import KV_DTYPES
from ...placement import GpuDevice, ModelLayout, Placement, plan_placement

__all__ = ["gpu_devices", "kv_bytes_per_cell_meta", "place", "plan_for", "read_gguf"]

LOGGER = logging.getLogger("tributary.engine.llama")

_GGML_DEVICE_GPU = 1  # enum ggml_backend_dev_type: CPU, GPU, IGPU, ACCEL
_GGML_DEVICE_IGPU = 2


#: What `gpu_devices` calls in ggml (ggml-backend.h's device API).
_DEVICE_API = (
    "ggml_backend_dev_count",
    "ggml_backend_dev_get",
    "ggml_backend_dev_name",
    "ggml_backend_dev_description",
    "ggml_backend_dev_type",
    "ggml_backend_dev_memory",
)


def _ggml_library() -> Any | None:
    """The ggml library llama_cpp loaded (its device registry), or None. First libllama's
    own handle: dlsym searches it and the libraries it was linked with, so this is the very
    ggml llama.cpp places layers with (a shared or a static build alike), never another
    libggml the system's library path might hold. Then the package's own libggml (Windows
    looks up no dependency's symbols through a handle)."""
    candidates = [getattr(llama_cpp.llama_cpp, "_lib", None)]
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml.so", "libggml.dylib", "ggml.dll"):
        try:
            candidates.append(ctypes.CDLL(str(lib_dir / name)))  # loaded: the same handle
        except OSError:
            continue
    return next(
        (
            lib
            for lib in candidates
            if lib is not None and all(hasattr(lib, f) for f in _DEVICE_API)
        ),
        None,
    )


def gpu_devices() -> list[GpuDevice]:
    """The GPUs llama.cpp would offload to, in its order (integrated ones only when there is
    no other), with their free memory now. Empty on a CPU-only build. Initializes the GPU
    backend on the calling thread (call it on the compute thread)."""
    if not llama_cpp.llama_supports_gpu_offload():
        return []
    lib = _ggml_library()
    if lib is None:
        LOGGER.warning("llama.cpp has a GPU backend, but its device list cannot be read")
        return []
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, fn).restype = ctypes.c_char_p
        getattr(lib, fn).argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    size_p = ctypes.POINTER(ctypes.c_size_t)
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size_p, size_p]
    found: dict[int, list[GpuDevice]] = {_GGML_DEVICE_GPU: [], _GGML_DEVICE_IGPU: []}
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(dev)
        if kind not in found:
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        name = (lib.ggml_backend_dev_name(dev) or b"?").decode(errors="replace")
        about = (lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace")
        found[kind].append(GpuDevice(name, about, free.value, total.value))
    return found[_GGML_DEVICE_GPU] or found[_GGML_DEVICE_IGPU]


# -- GGUF ------------------------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(file: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = file.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF file")
    return struct.unpack(fmt, data)[0]


def _string(file: BinaryIO) -> str:
    return file.read(_read(file, "<Q")).decode("utf-8", errors="replace")


def _value(file: BinaryIO, kind: int) -> Any:
    """A metadata value; an array's items are skipped (None) unless it holds numbers."""
    if kind == _STRING:
        return _string(file)
    if kind == _ARRAY:
        item, count = _read(file, "<I"), _read(file, "<Q")
        if item in _SCALARS:
            fmt = _SCALARS[item]
            return list(struct.unpack(f"<{count}{fmt[1]}", file.read(count * struct.calcsize(fmt))))
        for _ in range(count):
            _value(file, item)
        return None
    return _read(file, _SCALARS[kind])


def read_gguf(path: Path) -> tuple[ModelLayout, dict[str, Any]]:
    """The sizes of `path`'s layers (from its tensor table: each tensor's bytes is the
    distance to the next one's data) and its metadata (arrays of strings left out).
    ValueError for a file that is not a GGUF file."""
    try:
        return _read_gguf(path)
    except (KeyError, IndexError, struct.error, OverflowError, MemoryError) as exc:
        raise ValueError(f"{path} is not a GGUF file llama.cpp can load ({exc!r})") from None


def _read_gguf(path: Path) -> tuple[ModelLayout, dict[str, Any]]:
    with path.open("rb") as file:
        if file.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _read(file, "<I")  # version
        n_tensors, n_kv = _read(file, "<Q"), _read(file, "<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = _string(file)
            meta[key] = _value(file, _read(file, "<I"))
        tensors: list[tuple[int, str]] = []
        for _ in range(n_tensors):
            name = _string(file)
            file.seek(8 * _read(file, "<I") + 4, os.SEEK_CUR)  # dims, then the ggml type
            tensors.append((_read(file, "<Q"), name))
        alignment = int(meta.get("general.alignment", 32))
        data_start = -(-file.tell() // alignment) * alignment
    end = path.stat().st_size - data_start
    tensors.sort()
    sizes = {
        name: (tensors[i + 1][0] if i + 1 < len(tensors) else end) - offset
        for i, (offset, name) in enumerate(tensors)
    }
    arch = meta.get("general.architecture", "")
    n_layer = int(meta.get(f"{arch}.block_count", 0))
    layers = [0] * n_layer
    output = input_ = 0
    for name, size in sizes.items():
        if name.startswith("blk."):
            index = int(name.split(".")[1])
            if index < n_layer:
                layers[index] += size
                continue
        if name.startswith("output"):  # output.weight, output_norm.weight
            output += size
        else:
            input_ += size
    # A tied LM head: llama.cpp copies the embeddings to the output layer's device.
    tied = 0 if "output.weight" in sizes else sizes.get("token_embd.weight", 0)
    return ModelLayout(tuple(layers), input_, output, output + tied), meta


def kv_bytes_per_cell_meta(meta: dict[str, Any], bytes_per_element: float) -> int:
    """`loading.kv_bytes_per_cell` from the GGUF's metadata, before the model is loaded."""
    arch = meta.get("general.architecture", "")

    def get(name: str, default: int = 0) -> Any:
        return meta.get(f"{arch}.{name}", default)

    n_layer, n_embd = int(get("block_count")), int(get("embedding_length"))
    heads = get("attention.head_count", 1)
    kv_heads = get("attention.head_count_kv", heads)
    per_layer_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * n_layer
    head = n_embd // max(heads if isinstance(heads, int) else max(heads), 1)
    width = int(get("attention.key_length", head)) + int(get("attention.value_length", head))
    return math.ceil(sum(per_layer_heads) * width * bytes_per_element)


# -- the plan ---------------------------------------------------------------------------


def plan_for(path: Path, config: EngineConfig) -> Placement:
    """Where `path`'s layers and KV cache go under `config`, from its GGUF and the devices
    llama.cpp sees; InsufficientMemory when an explicit offload cannot fit on a device."""
    layout, meta = read_gguf(path)
    arch = meta.get("general.architecture", "")
    trained = int(meta.get(f"{arch}.context_length", 0)) or 1
    context = min(config.context_length or trained, trained)  # a longer one is refused later
    dtype = KV_DTYPES[config.kv_cache_dtype]
    # The embedding context's KV too, where there is a pooling type (embed.py).
    pooling = config.pooling or GGUF_POOLINGS.get(int(meta.get(f"{arch}.pooling_type", 0)))
    cells = config.kv_cells(context) + embedding_cells(config, context, pooling)
    kv_bytes = cells * kv_bytes_per_cell_meta(meta, dtype.bytes_per_element)
    devices = gpu_devices()
    if not devices:
        asked = _gpu_flags(config)
        if asked:
            LOGGER.warning(
                "%s ignored: %s",
                ", ".join(asked),
                "llama.cpp has no GPU backend (a CPU-only build)"
                if not llama_cpp.llama_supports_gpu_offload()
                else "llama.cpp found no GPU device",
            )
    return plan_placement(layout, devices, config, kv_bytes=kv_bytes)


def _gpu_flags(config: EngineConfig) -> list[str]:
    """The placement flags given that ask for a GPU (llama-server warns of the same)."""
    asked = []
    if config.n_gpu_layers not in ("auto", 0):
        asked.append(f"--n-gpu-layers {config.n_gpu_layers}")
    if config.main_gpu:
        asked.append(f"--main-gpu {config.main_gpu}")
    if config.split_mode != "layer":
        asked.append(f"--split-mode {config.split_mode}")
    if config.tensor_split:
        asked.append("--tensor-split " + ",".join(f"{x:g}" for x in config.tensor_split))
    return asked


def place(params: Any, placement: Placement, config: EngineConfig) -> Any:
    """Set llama_model_params' placement fields from `placement`; returns what must stay
    alive while the model loads (the tensor-split array llama.cpp reads)."""
    params.n_gpu_layers = placement.n_gpu_layers
    if not placement.gpu_backend:
        return None
    params.main_gpu = config.main_gpu
    params.split_mode = {
        "none": llama_cpp.LLAMA_SPLIT_MODE_NONE,
        "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
        "row": llama_cpp.LLAMA_SPLIT_MODE_ROW,
    }[config.split_mode]
    if not config.tensor_split:
        return None
    split = (ctypes.c_float * llama_cpp.llama_max_devices())(*config.tensor_split)
    params.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
    return split
