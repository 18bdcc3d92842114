"""Sizing the KV cache against the machine's memory (engine/kv_memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tributary.engine import EngineConfig
from tributary.engine.kv_memory import InsufficientMemory, check_memory, mem_available

GIB = 1 << 30


def test_mem_available_reads_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683652 kB\nMemAvailable:   1000 kB\n")
    no_cgroup = tmp_path / "no-cgroup"
    assert mem_available(meminfo, no_cgroup) == 1000 * 1024
    assert mem_available(tmp_path / "missing", no_cgroup) is None


def test_a_configuration_that_fits_passes_and_one_that_does_not_names_the_flags() -> None:
    config = EngineConfig(max_running_requests=8, prefix_cache_mb=1024)
    sizes = {"model_bytes": GIB // 10, "kv_bytes": 2 * GIB, "prefix_cache_bytes": GIB}
    check_memory(**sizes, available=4 * GIB, config=config, context_length=8192)
    check_memory(**sizes, available=None, config=config, context_length=8192)  # unknown
    with pytest.raises(InsufficientMemory) as caught:
        check_memory(**sizes, available=3 * GIB, config=config, context_length=8192)
    message = str(caught.value)
    assert "8 slots x 8192 cells" in message and "3.10 GiB" in message
    for flag in ("--context-length", "--max-running-requests", "--kv-cache-dtype", "--prefix"):
        assert flag in message


def test_kv_bytes_per_cell_reads_the_heads_widths_from_the_gguf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model whose heads are not n_embd / n_head wide (Qwen3-0.6B: 28
    layers, n_embd 1024, 16 heads of 128, 8 KV heads) is sized by its GGUF's key and value
    lengths, as llama.cpp allocates it, not at half its size."""
    import llama_cpp

    from tributary.engine.runners.llama import loading

    shape = {"n_embd": 1024, "n_head": 16, "n_head_kv": 8, "n_layer": 28}
    for name, value in shape.items():
        monkeypatch.setattr(llama_cpp, f"llama_model_{name}", lambda _m, v=value: v)
    meta = {
        b"general.architecture": "qwen3",
        b"qwen3.attention.key_length": "128",
        b"qwen3.attention.value_length": "128",
    }
    monkeypatch.setattr(loading, "model_meta", lambda _m, key: meta.get(key))
    assert loading.kv_bytes_per_cell(None, 2.0) == 28 * 8 * (128 + 128) * 2  # 114,688
    meta.clear()  # no such keys: n_embd / n_head, llama.cpp's default
    assert loading.kv_bytes_per_cell(None, 2.0) == 28 * 8 * (64 + 64) * 2


def test_a_cgroup_limit_lowers_what_is_available(tmp_path: Path) -> None:
    """In a container the kernel kills at the cgroup's limit, whatever MemAvailable says."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable: 6000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("2147483648\n")  # 2 GiB
    (cgroup / "memory.current").write_text("536870912\n")  # 0.5 GiB in use
    assert mem_available(meminfo, cgroup) == 1610612736
    (cgroup / "memory.max").write_text("max\n")  # no limit
    assert mem_available(meminfo, cgroup) == 6000000 * 1024
    assert mem_available(tmp_path / "missing", tmp_path / "none") is None
