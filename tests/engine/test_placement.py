"""Where layers and KV go (engine/placement.py), planned for fake devices: one H200, two GPUs
split by proportion, a GPU too small, auto fitting part of a model, a CPU-only build."""

from __future__ import annotations

import dataclasses

import pytest

from tributary.engine import EngineConfig
from tributary.engine.kv_memory import InsufficientMemory
from tributary.engine.placement import (
    DEVICE_HEADROOM,
    GpuDevice,
    ModelLayout,
    parse_gpu_layers,
    parse_tensor_split,
    plan_placement,
)

MIB, GIB = 1 << 20, 1 << 30

#: A 30-layer model shaped like SmolLM2-135M (Q4_1): 2 MiB a layer, 30 MiB of embeddings
#: tied to the LM head (so the output layer on a GPU is a copy of them).
SMOL = ModelLayout((2 * MIB,) * 30, 30 * MIB, 1 * MIB, 31 * MIB)
#: A 32-layer 8B-sized model: 200 MiB a layer, 500 MiB of embeddings, 500 MiB LM head.
BIG = ModelLayout((200 * MIB,) * 32, 500 * MIB, 500 * MIB, 500 * MIB)
H200 = GpuDevice("CUDA0", "NVIDIA H200", free=140 * GIB, total=141 * GIB)


def gpu(index: int, free_gib: float) -> GpuDevice:
    return GpuDevice(f"CUDA{index}", "NVIDIA L4", int(free_gib * GIB), 24 * GIB)


def test_one_h200_takes_every_layer_the_output_and_the_kv_by_default() -> None:
    placement = plan_placement(SMOL, [H200], EngineConfig(), kv_bytes=1024 * MIB)
    assert placement.n_gpu_layers == 31  # 30 layers and the output layer
    assert placement.summary == "30/30 layers and KV 1.00 GiB on CUDA0 (NVIDIA H200)"
    (share,) = placement.devices
    assert (share.layers, share.weight_bytes, share.kv_bytes) == (30, 91 * MIB, 1024 * MIB)
    # Only the input layer (token embeddings) stays in host memory; no KV does.
    assert (placement.host_weight_bytes, placement.host_kv_bytes) == (30 * MIB, 0)


def test_without_devices_everything_stays_in_host_memory_whatever_the_flags() -> None:
    config = EngineConfig(n_gpu_layers="all", split_mode="row", tensor_split=(3.0, 1.0))
    placement = plan_placement(SMOL, [], config, kv_bytes=64 * MIB)
    assert placement.n_gpu_layers == 0 and not placement.gpu_backend
    assert placement.summary == "0/30 layers on CPU (no GPU backend)"
    # The tied head is not copied in host memory: the file's sizes, once.
    assert placement.host_weight_bytes == 60 * MIB + 30 * MIB + 1 * MIB
    assert placement.host_kv_bytes == 64 * MIB
    assert placement.as_json()["devices"] == []


def test_zero_layers_on_a_gpu_build_keeps_everything_on_the_cpu_and_says_why() -> None:
    placement = plan_placement(SMOL, [H200], EngineConfig(n_gpu_layers=0), kv_bytes=64 * MIB)
    assert placement.summary == "0/30 layers on CPU (--n-gpu-layers 0)"
    assert placement.devices == () and placement.host_kv_bytes == 64 * MIB


def test_an_explicit_count_offloads_the_output_layer_first_then_the_last_layers() -> None:
    # llama.cpp's load_tensors (since ggml-org/llama.cpp#18148, in the vendored llama.cpp):
    # i_gpu_start = n_layer + 1 - n_gpu_layers, so N counts the output layer first and then
    # the repeating layers from the last down; N = n_layer leaves layer 0 on the CPU.
    placement = plan_placement(SMOL, [H200], EngineConfig(n_gpu_layers=30), kv_bytes=30 * MIB)
    assert placement.gpu_layers == 29
    assert placement.summary == (
        "29/30 layers and KV 29.00 MiB on CUDA0 (NVIDIA H200); 1/30 layers on CPU; "
        "output layer on GPU; KV 1.00 MiB in host memory"
    )
    placement = plan_placement(SMOL, [H200], EngineConfig(n_gpu_layers=10), kv_bytes=30 * MIB)
    # 9 layers and the output layer (a copy of the tied embeddings and the norm).
    assert placement.devices[0].weight_bytes == 9 * 2 * MIB + 31 * MIB
    assert placement.host_weight_bytes == 30 * MIB + 21 * 2 * MIB
    assert placement.host_kv_bytes == 21 * MIB  # the 21 layers left on the CPU keep theirs
    assert placement.summary.endswith(
        "; 21/30 layers on CPU; output layer on GPU; KV 21.00 MiB in host memory"
    )
    # One is the output layer alone.
    only_output = plan_placement(SMOL, [H200], EngineConfig(n_gpu_layers=1), kv_bytes=30 * MIB)
    assert only_output.gpu_layers == 0 and only_output.devices[0].weight_bytes == 31 * MIB
    assert only_output.host_weight_bytes == 30 * MIB + 30 * 2 * MIB
    # More than the model has is all of it, as llama.cpp clamps it.
    assert (
        plan_placement(SMOL, [H200], EngineConfig(n_gpu_layers=99), kv_bytes=0).n_gpu_layers == 31
    )


def test_no_kv_offload_keeps_all_the_kv_in_host_memory() -> None:
    config = EngineConfig(n_gpu_layers="all", kv_offload=False)
    placement = plan_placement(SMOL, [H200], config, kv_bytes=1024 * MIB)
    assert placement.devices[0].kv_bytes == 0 and placement.host_kv_bytes == 1024 * MIB
    assert placement.summary == ("30/30 layers on CUDA0 (NVIDIA H200); KV 1.00 GiB in host memory")


def test_two_gpus_split_layers_by_tensor_split_as_llama_cpp_assigns_them() -> None:
    config = EngineConfig(n_gpu_layers="all", tensor_split=(3.0, 1.0))
    placement = plan_placement(BIG, [gpu(0, 20), gpu(1, 20)], config, kv_bytes=32 * 64 * MIB)
    first, second = placement.devices
    # 33 offloaded (32 layers and the output): layer j goes to GPU 0 while j/33 < 0.75.
    assert (first.layers, second.layers) == (25, 7)
    assert first.weight_bytes == 25 * 200 * MIB
    assert second.weight_bytes == 7 * 200 * MIB + 500 * MIB  # the output goes to the last
    assert (first.kv_bytes, second.kv_bytes) == (25 * 64 * MIB, 7 * 64 * MIB)
    assert placement.summary.startswith("25/32 layers and KV 1.56 GiB on CUDA0 (NVIDIA L4), ")


def test_without_a_tensor_split_layers_follow_free_memory() -> None:
    placement = plan_placement(BIG, [gpu(0, 4), gpu(1, 12)], EngineConfig(), kv_bytes=0)
    first, second = placement.devices
    assert first.layers + second.layers == 32 and first.layers < second.layers
    assert first.layers == 9  # layers j of 33 with j / 33 < 4 / 16


def test_split_mode_none_puts_everything_on_the_main_gpu() -> None:
    config = EngineConfig(split_mode="none", main_gpu=1)
    placement = plan_placement(SMOL, [gpu(0, 20), gpu(1, 20)], config, kv_bytes=0)
    assert [share.name for share in placement.devices] == ["CUDA1"]
    assert placement.devices[0].layers == 30


def test_row_split_spreads_every_layers_rows_and_keeps_kv_with_the_layers_device() -> None:
    # llama.cpp assigns each layer a device by the proportions as in "layer" mode; "row"
    # only adds the split buffer type for its matrices, and the KV cache goes with
    # `dev_layer(il)`. main_gpu is read for "none" alone (llama_prepare_model_devices).
    config = EngineConfig(n_gpu_layers="all", split_mode="row", tensor_split=(1.0, 1.0))
    placement = plan_placement(BIG, [gpu(0, 20), gpu(1, 20)], config, kv_bytes=32 * MIB)
    first, second = placement.devices
    assert first.layers == second.layers == 32
    assert first.weight_bytes == second.weight_bytes == 32 * 100 * MIB + 250 * MIB
    # 33 offloaded (the 32 layers, then the output): j of 33 on GPU 0 while j / 33 < 0.5.
    assert (first.kv_bytes, second.kv_bytes) == (17 * MIB, 15 * MIB)
    row = EngineConfig(split_mode="row", main_gpu=1)
    assert plan_placement(SMOL, [H200], row, kv_bytes=0).devices  # not refused


def test_auto_offloads_the_most_layers_that_fit_and_the_rest_stays_on_the_cpu() -> None:
    # 2 GiB free: 1 GiB headroom leaves 1 GiB for the 500 MiB output layer, which goes
    # first, then 200 MiB layers with 64 MiB of KV each.
    small = gpu(0, 2)
    placement = plan_placement(BIG, [small], EngineConfig(), kv_bytes=32 * 64 * MIB)
    assert placement.n_gpu_layers == 2 and placement.gpu_layers == 1
    share = placement.devices[0]
    assert share.weight_bytes + share.kv_bytes + DEVICE_HEADROOM <= small.free
    assert placement.summary == (
        "1/32 layers and KV 64.00 MiB on CUDA0 (NVIDIA L4); 31/32 layers on CPU; "
        "output layer on GPU; KV 1.94 GiB in host memory"
    )
    # With the KV in host memory, more layers fit.
    no_kv = plan_placement(BIG, [small], EngineConfig(kv_offload=False), kv_bytes=32 * 64 * MIB)
    assert no_kv.n_gpu_layers == 3


def test_auto_on_a_gpu_with_no_room_places_nothing_there() -> None:
    placement = plan_placement(BIG, [gpu(0, 0.5)], EngineConfig(), kv_bytes=GIB)
    assert placement.n_gpu_layers == 0 and placement.devices == ()
    assert placement.summary == "0/32 layers on CPU (no room on the GPU)"
    assert placement.host_kv_bytes == GIB


def test_an_explicit_offload_that_does_not_fit_is_refused_with_the_flags_that_shrink_it() -> None:
    with pytest.raises(InsufficientMemory) as failure:
        plan_placement(BIG, [gpu(0, 2)], EngineConfig(n_gpu_layers="all"), kv_bytes=32 * 64 * MIB)
    message = str(failure.value)
    assert message.startswith("not enough memory on CUDA0 (NVIDIA L4): 32/32 layers there need")
    assert "2.00 GiB is free" in message
    assert "Lower --n-gpu-layers (at most 2 fit" in message
    for flag in ("--context-length", "--max-running-requests", "--kv-cache-dtype q8_0"):
        assert flag in message
    assert "--no-kv-offload" in message
    # The count it names does fit.
    assert plan_placement(BIG, [gpu(0, 2)], EngineConfig(n_gpu_layers=2), kv_bytes=32 * 64 * MIB)
    with pytest.raises(InsufficientMemory):
        plan_placement(BIG, [gpu(0, 2)], EngineConfig(n_gpu_layers=3), kv_bytes=32 * 64 * MIB)


def test_devices_that_are_not_there_are_refused() -> None:
    with pytest.raises(ValueError, match=r"--main-gpu 1: there is 1 GPU device \(CUDA0\)"):
        plan_placement(SMOL, [H200], EngineConfig(main_gpu=1, split_mode="none"), kv_bytes=0)
    # With whole layers spread by proportion, llama.cpp does not read it.
    assert plan_placement(SMOL, [H200], EngineConfig(main_gpu=1), kv_bytes=0).devices
    with pytest.raises(ValueError, match="--tensor-split names 2 devices, and there is 1"):
        plan_placement(SMOL, [H200], EngineConfig(tensor_split=(1.0, 1.0)), kv_bytes=0)


def test_server_info_field_is_plain_json() -> None:
    placement = plan_placement(SMOL, [H200], EngineConfig(), kv_bytes=MIB)
    fields = placement.as_json()
    assert fields["gpu_layers"] == 30 and fields["n_gpu_layers"] == 31
    assert fields["devices"] == [
        {
            "name": "CUDA0",
            "description": "NVIDIA H200",
            "layers": 30,
            "weight_bytes": 91 * MIB,
            "kv_bytes": MIB,
            "free": 140 * GIB,
        }
    ]
    assert fields["summary"] == placement.summary


@pytest.mark.parametrize(
    ("text", "value"), [("auto", "auto"), ("ALL", "all"), ("0", 0), ("99", 99)]
)
def test_gpu_layers_values(text: str, value: object) -> None:
    assert parse_gpu_layers(text) == value


@pytest.mark.parametrize("text", ["-1", "some", "1.5", ""])
def test_bad_gpu_layers_values_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--n-gpu-layers takes a number from 0, auto or all"):
        parse_gpu_layers(text)


def test_tensor_split_values() -> None:
    assert parse_tensor_split("3,1") == (3.0, 1.0)
    assert parse_tensor_split("0.5/0.5") == (0.5, 0.5)  # llama-server takes slashes too
    for bad in ("0,0", "a,b", "-1,2", ""):
        with pytest.raises(ValueError, match="--tensor-split takes proportions"):
            parse_tensor_split(bad)


def test_config_refuses_placement_values_that_make_no_sense() -> None:
    for fields in (
        {"n_gpu_layers": -1},
        {"n_gpu_layers": "most"},
        {"main_gpu": -1},
        {"split_mode": "tensor"},
        {"tensor_split": (0.0, 0.0)},
    ):
        with pytest.raises(ValueError):
            dataclasses.replace(EngineConfig(), **fields)  # type: ignore[arg-type]
