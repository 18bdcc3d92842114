"""Whether llama.cpp may repack the weights (`use_extra_bufts`), from the setting and how the
loaded llama.cpp was built and the model's weight types; and what `/get_server_info` reports
of it. Pure: the llama runner passes in `llama_print_system_info()`, the GGUF's tensor types
and the weight buffers llama.cpp logged.

Synopsis::

    choice = choose_repack(config.repack_weights, system_info, types, platform.machine())
    model_params.use_extra_bufts = choice.enabled  # (choose_repack: ValueError if refused)
    (LOGGER.warning if choice.warn else LOGGER.info)("%s", choice.reason)  # the one line

Repacking lays Q4_0, Q4_K, IQ4_NL (x86 AVX2) weights out for ggml's interleaved kernels
(`CPU_REPACK`), as llama-server does by default: prefill 1.4-1.6 times as fast for Q4_0 and
IQ4_NL here. "auto" repacks unless

- llama.cpp was compiled with AMX (what `pip install llama-cpp-python` compiles on an AMX
  Xeon): it then repacks for AMX, and every decode segfaults in `ggml_backend_amx_mul_mat`
  (docs/architecture.md, "Weight repacking"). Asking for repacking there is refused at
  start-up rather than left to crash; `just setup` installs an AMX-free build. A build whose
  system info lists no CPU features (a CPU backend loaded later) may have AMX: not repacked.
- the model has weights whose repacked kernels break batch invariance
  (`REPACK_BREAKS_INVARIANCE`: Q4_K, in every Q4_K_M GGUF), or the CPU is not x86-64, where
  the kernels are others and were not measured.

A model without repackable weights (SmolLM2's Q4_1) loads the same either way.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Literal, TypeAlias

__all__ = [
    "AMX_MARK",
    "REPACK_BREAKS_INVARIANCE",
    "RepackChoice",
    "RepackSetting",
    "WeightsRepack",
    "choose_repack",
    "weight_buffers",
]

#: `EngineConfig.repack_weights`: True (`--repack-weights on`), False (`off`) or "auto".
RepackSetting: TypeAlias = bool | Literal["auto"]

#: What `llama_print_system_info()` says of a llama.cpp compiled with AMX.
AMX_MARK = "AMX_INT8 = 1"
#: How it begins the CPU backend's features ("CPU : SSE3 = 1 | ...").
CPU_MARK = "CPU : "

#: How to get a llama.cpp without AMX, for the messages below.
FIX = (
    "`just setup` installs one without AMX (or reinstall llama-cpp-python with "
    "CMAKE_ARGS=\"-DGGML_NATIVE=ON '-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 "
    "-mno-amx-bf16' '-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'\")"
)


#: Weight types llama.cpp repacks on x86 (AVX2 and up) whose repacked kernels make a row's
#: result depend on the rows beside it (docs/benchmarks/repack.md): Q4_K's gemm (4 rows at a
#: time) and gemv round differently (greedy output changed in 4 of 8 prompts, logits up to
#: 2.0 apart). Q2_K (AVX-512) and MXFP4 are not measured, so they count as breaking it. The
#: other two it repacks there, Q4_0 and IQ4_NL, measured invariant: greedy output alone and
#: beside 4 or 7 others the same, logits to the bit.
REPACK_BREAKS_INVARIANCE = frozenset({"Q4_K", "Q2_K", "MXFP4"})
#: Where the figures above were measured.
MEASURED_MACHINES = frozenset({"x86_64", "amd64"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class RepackChoice:
    """What to load with: `enabled` is `use_extra_bufts`; `reason` is the log line."""

    setting: RepackSetting
    enabled: bool
    llama_cpp_amx: bool
    reason: str
    #: True when the line is a warning: AMX keeps repacking off, or `on` gives up batch
    #: invariance.
    warn: bool = False


def choose_repack(
    setting: RepackSetting,
    system_info: str,
    weight_types: frozenset[str] = frozenset(),
    machine: str = "x86_64",
) -> RepackChoice:
    """The choice for `setting` with the llama.cpp whose `llama_print_system_info()` is
    `system_info`, for a model whose tensors have `weight_types` (ggml's names), on a CPU of
    `machine` (`platform.machine()`). ValueError when repacking is asked for and AMX is
    compiled in."""
    amx = AMX_MARK in system_info
    # A build that loads its CPU backend later (GGML_BACKEND_DL) lists no CPU features yet:
    # AMX may be in it, so "auto" does not repack.
    cpu_listed = CPU_MARK in system_info
    breaking = sorted(weight_types & REPACK_BREAKS_INVARIANCE)
    measured = machine.lower() in MEASURED_MACHINES
    if setting is True and amx:
        raise ValueError(
            "--repack-weights on: this llama.cpp was compiled with AMX, whose repacked "
            f"weights crash every decode; {FIX}, or leave --repack-weights at auto"
        )
    warn = False
    if setting is True:
        reason = "weights repacked where llama.cpp has kernels for them (--repack-weights on)"
        if breaking:
            warn = True
            reason += (
                f"; the repacked {'/'.join(breaking)} kernels make a sequence's greedy "
                "output depend on the batch beside it"
            )
    elif setting is False:
        reason = "weights not repacked (--repack-weights off)"
    elif amx:
        warn = True
        reason = (
            "weights not repacked: this llama.cpp was compiled with AMX, whose repacked "
            f"weights crash every decode; {FIX}"
        )
    elif not cpu_listed:
        warn = True
        reason = (
            "weights not repacked: llama.cpp's system info lists no CPU features, so whether "
            f"it was compiled with AMX is unknown (--repack-weights on repacks anyway): {FIX}"
        )
    elif breaking:
        reason = (
            f"weights not repacked: llama.cpp's repacked {'/'.join(breaking)} kernels make a "
            "sequence's greedy output depend on the batch beside it (--repack-weights on "
            "repacks anyway)"
        )
    elif not measured:
        reason = (
            f"weights not repacked: repacked kernels are checked for batch invariance on "
            f"x86-64 only, not {machine} (--repack-weights on repacks anyway)"
        )
    else:
        reason = "weights repacked where llama.cpp has kernels for them (auto: no AMX)"
    enabled = setting is True or (
        setting == "auto" and not amx and cpu_listed and not breaking and measured
    )
    return RepackChoice(
        setting=setting, enabled=enabled, llama_cpp_amx=amx, reason=reason, warn=warn
    )


#: llama.cpp's line for each weight buffer as it loads: "load_tensors:   CPU_REPACK model
#: buffer size =    58.50 MiB".
_BUFFER_LINE = re.compile(r"(\S+) model buffer size =\s*([0-9.]+) MiB")


def weight_buffers(log_text: str) -> dict[str, float]:
    """MiB per weight buffer type from llama.cpp's loading log ("CPU", "CPU_Mapped",
    "CPU_REPACK", "AMX", "CUDA0", ...)."""
    buffers: dict[str, float] = {}
    for name, mib in _BUFFER_LINE.findall(log_text):
        buffers[name] = buffers.get(name, 0.0) + float(mib)
    return buffers


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightsRepack:
    """`/get_server_info`'s `weights_repack`: the choice, and what llama.cpp then did."""

    choice: RepackChoice
    #: MiB per weight buffer type as llama.cpp logged them (empty: it logged none).
    buffers: Mapping[str, float]

    @property
    def repacked_mib(self) -> float:
        """Weights llama.cpp laid out for its repacked kernels (CPU_REPACK, AMX)."""
        return sum(mib for name, mib in self.buffers.items() if "REPACK" in name or name == "AMX")

    def as_json(self) -> dict[str, object]:
        return {
            "setting": self.choice.setting,
            "enabled": self.choice.enabled,
            "repacked": self.repacked_mib > 0,
            "repacked_mib": round(self.repacked_mib, 2),
            "buffers_mib": dict(self.buffers),
            "llama_cpp_amx": self.choice.llama_cpp_amx,
            "reason": self.choice.reason,
        }
