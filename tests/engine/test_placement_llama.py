"""The llama runner's side of placement (engine/runners/llama/devices.py) on the real model:
the GGUF's layer sizes as llama.cpp counts them, the devices of this build, and the model
parameters a plan sets."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import pytest

from tributary.engine import EngineConfig
from tributary.engine.placement import GpuDevice, plan_placement
from tributary.engine.runners.llama import default_model_path, load_model
from tributary.engine.runners.llama.devices import (
    gpu_devices,
    kv_bytes_per_cell_meta,
    place,
    plan_for,
    read_gguf,
)
from tributary.engine.runners.llama.loading import kv_bytes_per_cell

CPU_ONLY = not llama_cpp.llama_supports_gpu_offload()


def test_the_gguf_layout_adds_up_to_what_llama_cpp_loads() -> None:
    path = default_model_path()
    layout, meta = read_gguf(path)
    model, _ = load_model(path, EngineConfig(mmap_weights=True))
    try:
        assert layout.n_layer == llama_cpp.llama_model_n_layer(model) == 30
        # Every tensor once: the layers, the embeddings and the output norm (the LM head is
        # tied to the embeddings, so on a GPU the output layer carries a copy of them).
        stored = sum(layout.layer_bytes) + layout.input_bytes + layout.output_bytes
        assert stored == llama_cpp.llama_model_size(model)
        assert layout.output_device_bytes == layout.output_bytes + layout.input_bytes
        assert len(set(layout.layer_bytes)) == 1  # SmolLM2's layers are all alike
        for element in (2.0, 34 / 32):
            assert kv_bytes_per_cell_meta(meta, element) == kv_bytes_per_cell(model, element)
    finally:
        llama_cpp.llama_model_free(model)


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ValueError, match=r"model\.gguf is not a GGUF file"):
        read_gguf(bad)


@pytest.mark.skipif(not CPU_ONLY, reason="this build has a GPU backend")
def test_a_cpu_only_build_has_no_devices_and_loads_every_layer_on_the_cpu(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert gpu_devices() == []
    placement = plan_for(default_model_path(), EngineConfig(n_gpu_layers="all", main_gpu=1))
    assert placement.summary == "0/30 layers on CPU (no GPU backend)"
    assert "--n-gpu-layers all, --main-gpu 1 ignored: llama.cpp has no GPU backend" in caplog.text
    params = llama_cpp.llama_model_default_params()
    assert params.n_gpu_layers != 0  # llama.cpp's own default: every layer on a GPU
    place(params, placement, EngineConfig())
    assert params.n_gpu_layers == 0


def test_a_plan_for_two_gpus_sets_llama_cpps_model_parameters() -> None:
    layout, _ = read_gguf(default_model_path())
    devices = [GpuDevice(f"CUDA{i}", "test", 80 << 30, 80 << 30) for i in range(2)]
    config = EngineConfig(split_mode="row", main_gpu=1, tensor_split=(3.0, 1.0))
    placement = plan_placement(layout, devices, config, kv_bytes=1 << 20)
    params = llama_cpp.llama_model_default_params()
    keep = place(params, placement, config)
    assert keep is not None
    assert params.n_gpu_layers == 31 and params.main_gpu == 1
    assert params.split_mode == llama_cpp.LLAMA_SPLIT_MODE_ROW
    split = ctypes.cast(params.tensor_split, ctypes.POINTER(ctypes.c_float))
    assert [split[i] for i in range(3)] == [3.0, 1.0, 0.0]


def test_the_device_list_is_read_from_the_ggml_llama_cpp_uses() -> None:
    # libllama's handle resolves ggml's symbols in the libggml it was linked with; a bare
    # "libggml.so" could be another build on the system's library path.
    from tributary.engine.runners.llama.devices import _ggml_library

    assert _ggml_library() is llama_cpp.llama_cpp._lib


def test_a_ggml_without_the_device_api_reads_no_devices_and_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Partial:  # a ggml with the device count and nothing else of the device API
        def ggml_backend_dev_count(self) -> int:
            return 1

    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    monkeypatch.setattr(llama_cpp.llama_cpp, "_lib", Partial())
    monkeypatch.setattr(llama_cpp, "__file__", str(tmp_path / "llama_cpp" / "__init__.py"))
    assert gpu_devices() == []
    assert "its device list cannot be read" in caplog.text
