"""Where a model's layers and KV cache go: GPU devices or host memory, and refusing a
configuration that cannot fit on them. A pure function of sizes, devices and flags.

Synopsis::

    placement = plan_placement(layout, devices, config, kv_bytes=kv)  # or InsufficientMemory
    LOGGER.info("%s", placement.summary)  # "31/31 layers and KV 1.00 GiB on CUDA0 (NVIDIA H200)"

The flags are llama-server's (`--n-gpu-layers N|auto|all`, `--main-gpu`, `--split-mode`,
`--tensor-split`, `--no-kv-offload`) and mean what they mean there, as llama.cpp's loader
places layers (`llama_model::load_tensors`):

- `n_gpu_layers` counts the output layer (final norm and LM head) first, then the repeating
  layers from the last down (`i_gpu_start = L + 1 - N`, since ggml-org/llama.cpp#18148): N = 1
  offloads the output layer alone, N of L + 1 offloads it and layers L-N+1 to L-1, N = L
  leaves layer 0 in host memory. The input layer (token embeddings) always stays in host
  memory. "all" is L + 1; "auto" is the most that fit, every device keeping
  `DEVICE_HEADROOM` free for compute buffers.
- `split_mode` "none" puts every offloaded layer on `main_gpu`; "layer" spreads whole layers
  over the GPUs in proportion to `tensor_split` (default: each device's free memory); "row"
  assigns layers to devices the same way, and spreads each one's matrices by rows in that
  proportion (llama.cpp reads `main_gpu` with "none" only).
- A layer's KV cache lives with the layer, unless `kv_offload` is off: then all of it is in
  host memory (llama-server's `--no-kv-offload`).

Without GPU devices (a CPU-only llama.cpp build, or one that finds none) everything is in
host memory whatever the flags say, as llama-server ignores them there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from .config import EngineConfig
from .kv_memory import InsufficientMemory, describe_bytes

__all__ = [
    "DEVICE_HEADROOM",
    "DeviceShare",
    "GpuDevice",
    "ModelLayout",
    "Placement",
    "parse_gpu_layers",
    "parse_tensor_split",
    "plan_placement",
]

#: Device memory each GPU keeps free beyond weights and KV: the compute buffers of a decode
#: and the backend's own (CUDA's context takes a few hundred MiB); llama.cpp's `--fit`
#: leaves the same margin by default (`--fit-target 1024` MiB).
DEVICE_HEADROOM = 1 << 30


@dataclasses.dataclass(frozen=True)
class GpuDevice:
    """A GPU llama.cpp can offload to, in llama.cpp's order (`--main-gpu` and
    `--tensor-split` index this order)."""

    name: str  # "CUDA0"
    description: str  # "NVIDIA H200"
    free: int  # bytes free now
    total: int


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """A model's weights by layer, as its GGUF stores them."""

    layer_bytes: tuple[int, ...]  # each repeating layer (`blk.N.*`), in order
    input_bytes: int  # token embeddings (and whatever else is not a layer or the output)
    output_bytes: int  # the final norm and LM head in host memory (a tied head: the norm)
    #: The output layer on a GPU: a tied LM head is then a copy of the embeddings there.
    output_device_bytes: int

    @property
    def n_layer(self) -> int:
        return len(self.layer_bytes)


@dataclasses.dataclass(frozen=True)
class DeviceShare:
    """What one GPU holds."""

    name: str
    description: str
    layers: int  # repeating layers (a row split counts every layer it holds rows of)
    weight_bytes: int
    kv_bytes: int
    free: int  # bytes free before loading


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the layers and the KV cache go (`plan_placement`)."""

    n_layer: int
    #: llama.cpp's `n_gpu_layers`, as loaded: the output layer, then `gpu_layers` layers.
    n_gpu_layers: int
    gpu_backend: bool  # llama.cpp was built with one and found a device
    requested: str  # `--n-gpu-layers` as given: a number, "auto" or "all"
    split_mode: str
    kv_offload: bool
    devices: tuple[DeviceShare, ...]  # the GPUs that hold something
    host_weight_bytes: int
    host_kv_bytes: int

    @property
    def gpu_layers(self) -> int:
        """Repeating layers on GPUs (the output layer is offloaded first)."""
        return max(min(self.n_gpu_layers, self.n_layer + 1) - 1, 0)

    @property
    def offloaded(self) -> bool:
        return self.n_gpu_layers > 0

    @property
    def summary(self) -> str:
        """One line: where the layers and the KV cache went."""
        if not self.gpu_backend:
            return f"0/{self.n_layer} layers on CPU (no GPU backend)"
        if not self.offloaded:
            why = "--n-gpu-layers 0" if self.requested == "0" else "no room on the GPU"
            return f"0/{self.n_layer} layers on CPU ({why})"
        kv_on = " and KV " if self.kv_offload else " "
        parts = []
        for share in self.devices:
            kv = f"{describe_bytes(share.kv_bytes)} " if self.kv_offload else ""
            parts.append(
                f"{share.layers}/{self.n_layer} layers{kv_on}{kv}on {share.name} "
                f"({share.description})"
            )
        line = ", ".join(parts)
        cpu_layers = self.n_layer - self.gpu_layers
        if cpu_layers:  # llama.cpp offloads the output layer first (plan_placement)
            line += f"; {cpu_layers}/{self.n_layer} layers on CPU; output layer on GPU"
        if self.host_kv_bytes:
            line += f"; KV {describe_bytes(self.host_kv_bytes)} in host memory"
        return line

    def as_json(self) -> dict[str, object]:
        """`/get_server_info`'s `placement` field."""
        return {
            "summary": self.summary,
            "n_layer": self.n_layer,
            "gpu_layers": self.gpu_layers,
            "n_gpu_layers": self.n_gpu_layers,
            "gpu_backend": self.gpu_backend,
            "requested": self.requested,
            "split_mode": self.split_mode,
            "kv_offload": self.kv_offload,
            "devices": [dataclasses.asdict(share) for share in self.devices],
            "host_weight_bytes": self.host_weight_bytes,
            "host_kv_bytes": self.host_kv_bytes,
        }


def parse_gpu_layers(text: str) -> int | str:
    """`--n-gpu-layers`' value: a number from 0, "auto" or "all" (llama-server's)."""
    value = text.strip().lower()
    if value in ("auto", "all"):
        return value
    try:
        layers = int(value)
    except ValueError:
        layers = -1
    if layers < 0:
        raise ValueError(f"--n-gpu-layers takes a number from 0, auto or all, got {text!r}")
    return layers


def parse_tensor_split(text: str) -> tuple[float, ...]:
    """`--tensor-split`'s value: proportions separated by commas (or slashes, as llama-server
    takes them), such as 3,1."""
    try:
        split = tuple(float(x) for x in text.replace("/", ",").split(",") if x.strip())
    except ValueError:
        split = ()
    if not split or any(not (x >= 0 and math.isfinite(x)) for x in split) or not sum(split) > 0:
        raise ValueError(
            "--tensor-split takes proportions from 0 separated by commas, such as 3,1, "
            f"got {text!r}"
        )
    return split


def plan_placement(
    layout: ModelLayout,
    devices: Sequence[GpuDevice],
    config: EngineConfig,
    *,
    kv_bytes: int,
    headroom: int = DEVICE_HEADROOM,
) -> Placement:
    """Place `layout`'s layers and `kv_bytes` of KV cache (all layers together) on `devices`
    as `config`'s placement flags say. Raises InsufficientMemory, naming the flags that
    shrink what a device must hold, when an explicit `n_gpu_layers` (or "all") does not fit,
    and ValueError for a `main_gpu` or `tensor_split` that names devices there are not.
    Host memory is not checked here: the caller checks `host_weight_bytes` and
    `host_kv_bytes` with the rest of what the process allocates (`check_memory`)."""
    n_layer = layout.n_layer
    if not devices:
        return _placement(layout, config, kv_bytes, (), 0, [], gpu_backend=False)
    fractions = _fractions(devices, config)

    def shares_for(n: int) -> list[list[int]]:
        return _shares(layout, devices, fractions, config, kv_bytes, n)

    def most_that_fit(n: int) -> int:
        fit = (k for k in range(n, 0, -1) if not _overfull(shares_for(k), devices, headroom))
        return next(fit, 0)

    wanted = config.n_gpu_layers
    if wanted == "auto":
        n = most_that_fit(n_layer + 1) if n_layer else 0
        return _placement(layout, config, kv_bytes, devices, n, shares_for(n))
    n = n_layer + 1 if wanted == "all" else min(int(wanted), n_layer + 1)
    shares = shares_for(n)
    overfull = _overfull(shares, devices, headroom)
    if overfull:
        fitting = most_that_fit(n)
        index, need = overfull[0]
        device = devices[index]
        raise InsufficientMemory(
            f"not enough memory on {device.name} ({device.description}): "
            f"{shares[index][0]}/{n_layer} layers there need {describe_bytes(need)} "
            f"(weights and KV, plus {describe_bytes(headroom)} for compute buffers), and "
            f"{describe_bytes(device.free)} is free. Lower --n-gpu-layers (at most {fitting} "
            "fit; auto places as many as fit), shrink the KV cache with --context-length, "
            "--max-running-requests or --kv-cache-dtype q8_0, "
            "or keep it in host memory with --no-kv-offload."
        )
    return _placement(layout, config, kv_bytes, devices, n, shares)


def _fractions(devices: Sequence[GpuDevice], config: EngineConfig) -> list[float]:
    """Each device's share of the offloaded layers (they sum to 1)."""
    count = len(devices)
    # llama.cpp reads main_gpu with "none" only (llama_prepare_model_devices).
    if config.split_mode == "none" and not 0 <= config.main_gpu < count:
        raise ValueError(
            f"--main-gpu {config.main_gpu}: there {'is' if count == 1 else 'are'} {count} "
            f"GPU device{'' if count == 1 else 's'} ({', '.join(d.name for d in devices)})"
        )
    if config.split_mode == "none":
        return [1.0 if i == config.main_gpu else 0.0 for i in range(count)]
    split = list(config.tensor_split)
    if split:
        if len(split) > count:
            raise ValueError(
                f"--tensor-split names {len(split)} devices, and there "
                f"{'is' if count == 1 else 'are'} {count}"
            )
        weights = split + [0.0] * (count - len(split))
    else:  # llama.cpp's default: in proportion to each device's free memory
        weights = [float(max(d.free, 0)) for d in devices]
    total = sum(weights)
    if total <= 0:  # no device reports free memory: all on the first
        return [1.0 if i == 0 else 0.0 for i in range(count)]
    return [w / total for w in weights]


def _layer_devices(fractions: list[float], offloaded: int) -> list[int]:
    """The device of each offloaded layer, first to last, as llama.cpp assigns them: layer
    j of k goes to the first device whose cumulative share exceeds j / k."""
    bounds, running = [], 0.0
    for f in fractions:
        running += f
        bounds.append(running)
    last = max(i for i, f in enumerate(fractions) if f > 0)
    return [
        next((i for i, b in enumerate(bounds) if b > j / offloaded and fractions[i] > 0), last)
        for j in range(offloaded)
    ]


def _shares(
    layout: ModelLayout,
    devices: Sequence[GpuDevice],
    fractions: list[float],
    config: EngineConfig,
    kv_bytes: int,
    n: int,
) -> list[list[int]]:
    """[layers, weight bytes, KV bytes] on each device with llama.cpp's `n_gpu_layers` = n:
    the output layer and the last n - 1 layers."""
    shares = [[0, 0, 0] for _ in devices]  # the third: layers whose KV is there, until the end
    n_layer = layout.n_layer
    if not n:
        return _kv_of(shares, kv_bytes, n_layer)
    # llama.cpp's load_tensors: entities i_gpu_start..L (L: the output layer) are offloaded,
    # the j-th of the n to the device its cumulative proportion reaches.
    first = n_layer + 1 - n
    owners = _layer_devices(fractions, n)
    row = config.split_mode == "row"

    def put(owner: int, size: int) -> None:
        if not row:
            shares[owner][1] += size
            return
        for i, f in enumerate(fractions):  # the split buffer: each matrix's rows spread
            if f > 0:
                shares[i][1] += math.ceil(size * f)

    for j, il in enumerate(range(first, n_layer)):
        for i, f in enumerate(fractions):
            if i == owners[j] or (row and f > 0):
                shares[i][0] += 1
        put(owners[j], layout.layer_bytes[il])
        if config.kv_offload:
            shares[owners[j]][2] += 1  # llama.cpp's KV cache: `model.dev_layer(il)`
    put(owners[-1], layout.output_device_bytes)
    return _kv_of(shares, kv_bytes, n_layer)


def _kv_of(shares: list[list[int]], kv_bytes: int, n_layer: int) -> list[list[int]]:
    """Each device's count of KV layers turned into bytes (every layer's KV is the same)."""
    for share in shares:
        share[2] = kv_bytes * share[2] // n_layer if n_layer else 0
    return shares


def _overfull(
    shares: list[list[int]], devices: Sequence[GpuDevice], headroom: int
) -> list[tuple[int, int]]:
    """(device index, bytes needed) for each device that cannot hold its share."""
    return [
        (i, weights + kv + headroom)
        for i, (_, weights, kv) in enumerate(shares)
        if weights + kv and weights + kv + headroom > devices[i].free
    ]


def _placement(
    layout: ModelLayout,
    config: EngineConfig,
    kv_bytes: int,
    devices: Sequence[GpuDevice],
    n: int,
    shares: list[list[int]],
    *,
    gpu_backend: bool = True,
) -> Placement:
    on_devices = tuple(
        DeviceShare(d.name, d.description, layers, weights, kv, d.free)
        for d, (layers, weights, kv) in zip(devices, shares, strict=True)
        if weights or kv
    )
    device_kv = sum(s.kv_bytes for s in on_devices)
    host_layers = layout.n_layer + 1 - n if n else layout.n_layer  # llama.cpp's i_gpu_start
    host_weights = layout.input_bytes + sum(layout.layer_bytes[:host_layers])
    return Placement(
        n_layer=layout.n_layer,
        n_gpu_layers=n,
        gpu_backend=gpu_backend,
        requested=str(config.n_gpu_layers),
        split_mode=config.split_mode,
        kv_offload=config.kv_offload,
        devices=on_devices,
        host_weight_bytes=host_weights + (0 if n else layout.output_bytes),
        host_kv_bytes=max(kv_bytes - device_kv, 0) if on_devices else kv_bytes,
    )
