"""How much memory a configuration's KV cache takes, and refusing one that cannot fit.

Each running slot holds a whole `context_length` of KV cells (docs/architecture.md, "KV
cache"), so the KV cache is `max_running_requests x context_length` cells whatever the
requests need: 1.4 GiB for SmolLM2 at the defaults, tens of GB for a 7B model. The engine
checks it against the machine's available memory before allocating it, and says which flags
shrink it, instead of being killed by the kernel later.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .config import EngineConfig

__all__ = [
    "KV_DTYPES",
    "InsufficientMemory",
    "KVDtype",
    "check_memory",
    "describe_bytes",
    "mem_available",
]

#: ggml type ids (ggml.h), so this module needs no llama_cpp import.
_GGML_TYPE_F16 = 1
_GGML_TYPE_Q8_0 = 8


@dataclasses.dataclass(frozen=True)
class KVDtype:
    ggml_type: int
    bytes_per_element: float
    quantized: bool


#: `--kv-cache-dtype` values. "auto" is the model's usual f16 (SGLang's spelling for "what
#: the model uses"); q8_0 stores 32 values in 34 bytes, about half of f16.
KV_DTYPES = {
    "auto": KVDtype(_GGML_TYPE_F16, 2.0, quantized=False),
    "f16": KVDtype(_GGML_TYPE_F16, 2.0, quantized=False),
    "q8_0": KVDtype(_GGML_TYPE_Q8_0, 34 / 32, quantized=True),
}


class InsufficientMemory(ValueError):
    """The model and the KV cache a configuration allocates exceed the available memory."""


def mem_available(
    meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Memory a new program can use without swapping or being killed, in bytes: Linux's
    MemAvailable (free memory plus reclaimable caches), lowered to what the process's cgroup
    v2 limit still allows (`memory.max` minus `memory.current`) when it runs in a container
    with one. None when neither can be read."""
    available: int | None = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int((cgroup / "memory.current").read_text().strip())
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def describe_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def check_memory(
    *,
    model_bytes: int,
    kv_bytes: int,
    prefix_cache_bytes: int,
    available: int | None,
    config: EngineConfig,
    context_length: int,
    embedding_kv_bytes: int = 0,
) -> None:
    """Raise InsufficientMemory if the model, the KV cache (`kv_bytes`, the embedding
    context's `embedding_kv_bytes` of it included) and the prefix cache's bound need more
    than `available` bytes (None: unknown, nothing is checked)."""
    need = model_bytes + kv_bytes + prefix_cache_bytes
    if available is None or need <= available:
        return
    embedding = (
        f", and {describe_bytes(embedding_kv_bytes)} for embeddings (--embedding-context-length)"
        if embedding_kv_bytes
        else ""
    )
    raise InsufficientMemory(
        f"not enough memory: the model ({describe_bytes(model_bytes)}) plus its KV cache "
        f"({describe_bytes(kv_bytes)}: {config.max_running_requests} slots x "
        f"{context_length} cells, {config.kv_cache_dtype}{embedding}) plus the prefix "
        "cache's bound "
        f"({describe_bytes(prefix_cache_bytes)}) need {describe_bytes(need)}, and "
        f"{describe_bytes(available)} is available. Shrink the KV cache with "
        "--context-length, --max-running-requests or --kv-cache-dtype q8_0, or the prefix "
        "cache with --prefix-cache-mb."
    )
