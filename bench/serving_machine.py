"""What bench/serving.py records of the machine and of each server's llama.cpp: the CPU's
model name and the instruction sets llama.cpp's CPU kernels choose between, how each server's
llama.cpp was built, and whether each repacks its weights.

- The CPU: `model name` and the flags of /proc/cpuinfo that matter (ISA_FLAGS), present or not.
- llama-server (bench/peers.py's build): the cmake flags and llama.cpp commit of its build.json,
  and a probe: the binary started once with `-v` on the benchmark's model, its `system_info`
  line (the kernels compiled in) and its CPU_REPACK lines (which tensors were repacked, or
  "cannot be used with preferred buffer type CPU_REPACK" when none can be: SmolLM2's Q4_1 and
  Q8_0 tensors have no repacked layout). llama-server repacks by default, unless
  `--no-repack`.
- Tributary: the llama-cpp-python of its venv, its version and `llama_print_system_info()`,
  read in a subprocess; whether the running server repacks: every field of /get_server_info
  whose name says `repack`, and any server log line that mentions repacking or AMX.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

#: The CPU flags that decide which of llama.cpp's x86 kernels run and which repacked layouts
#: exist (AVX2 and AVX-512 for Q4_0/IQ4_NL/Q4_K repacking, VNNI for int8 dot products, AMX
#: for ggml's AMX buffer type).
ISA_FLAGS = (
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)

#: Prints the venv's llama-cpp-python version and system info as one JSON line.
LLAMA_CPP_PYTHON_INFO = (
    "import json, llama_cpp; print(json.dumps({'version': llama_cpp.__version__, "
    "'system_info': llama_cpp.llama_print_system_info().decode()}))"
)


def cpu_facts(cpuinfo: str) -> dict[str, Any]:
    """The first CPU's model name and, for each of ISA_FLAGS, whether it has it."""
    model, flags = "unknown", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return {"cpu": model, "isa": {flag: flag in flags for flag in ISA_FLAGS}}


def isa_line(isa: dict[str, bool]) -> str:
    """`avx2 avx512f ... (no amx_tile, ...)`: what the CPU has, then what it lacks."""
    have = [flag for flag, present in isa.items() if present]
    lacks = [flag for flag, present in isa.items() if not present]
    return " ".join(have) + (f" (not: {' '.join(lacks)})" if lacks else "")


def parse_system_info(text: str) -> dict[str, str]:
    """llama.cpp's `system_info` (`CPU : SSE3 = 1 | AVX2 = 1 | ... | REPACK = 1 |`) as
    {feature: value}; what precedes `CPU :` (thread counts) is left out."""
    _, _, tail = text.partition("CPU :")
    features = {}
    for part in (tail or text).split("|"):
        name, sep, value = part.partition("=")
        if sep and name.strip():
            features[name.strip()] = value.strip()
    return features


def compiled_kernels(features: dict[str, str]) -> str:
    """The features a system_info turned on, as one line (`AVX2 AVX512 ... REPACK`)."""
    return " ".join(name for name, value in features.items() if value == "1")


def repack_from_log(lines: list[str]) -> dict[str, Any]:
    """What llama.cpp's load log says of repacking: the size of the CPU_REPACK buffer (0 when
    no tensor could use it, None when the log says nothing), and the lines it read."""
    found = [line.strip() for line in lines if "REPACK" in line or "AMX" in line.upper()]
    sizes = [
        float(m[1])
        for line in found
        if (m := re.search(r"CPU_REPACK\s+model buffer size\s*=\s*([0-9.]+)\s*MiB", line))
    ]
    refused = any("cannot be used with preferred buffer type CPU_REPACK" in line for line in found)
    if sizes:
        repacked_mib: float | None = sum(sizes)
    elif refused:
        repacked_mib = 0.0
    else:
        repacked_mib = None
    return {"repacked_mib": repacked_mib, "lines": found[:8]}


def probe_llama_server(
    binary: Path, model: Path, port: int, timeout: float = 90.0
) -> dict[str, Any]:
    """Start llama-server once with `-v` on `model` (one slot, a small context), read its
    load log until it listens, stop it: its system_info and what it did with CPU_REPACK."""
    argv = [str(binary), "-m", str(model), "-v", "-c", "512", "-np", "1", "-t", "2"]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            # Keep what matters only: -v logs every tensor (thousands of lines).
            if "system_info" in line or "REPACK" in line or "buffer size" in line:
                lines.append(line)
            if "listening on" in line or time.monotonic() > deadline:
                break
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    system = next((line for line in lines if "system_info" in line), "")
    features = parse_system_info(system)
    return {
        "system_info": compiled_kernels(features),
        "amx": any(name.startswith("AMX") for name, v in features.items() if v == "1"),
    } | repack_from_log(lines)


def llama_cpp_python_info(python: Path) -> dict[str, Any]:
    """The version and system info of the llama-cpp-python that `python` imports."""
    proc = subprocess.run(
        [str(python), "-c", LLAMA_CPP_PYTHON_INFO], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-500:]}
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    features = parse_system_info(info["system_info"])
    return {
        "version": info["version"],
        "system_info": compiled_kernels(features),
        "amx": any(name.startswith("AMX") for name, v in features.items() if v == "1"),
    }


def repack_fields(info: Any, prefix: str = "") -> dict[str, Any]:
    """Every field of a /get_server_info answer whose name mentions repacking, at any depth,
    by its dotted path."""
    found: dict[str, Any] = {}
    if isinstance(info, dict):
        for key, value in info.items():
            path = f"{prefix}{key}"
            if "repack" in str(key).lower():
                found[path] = value
            else:
                found |= repack_fields(value, path + ".")
    elif isinstance(info, list):
        for i, value in enumerate(info):
            found |= repack_fields(value, f"{prefix}{i}.")
    return found


def log_mentions(path: Path, words: tuple[str, ...] = ("repack", "amx")) -> list[str]:
    """A server log's lines that mention any of `words` (at most 8)."""
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").splitlines()
        return [line.strip()[:300] for line in lines if any(w in line.lower() for w in words)][:8]
    return []


def repack_summary(facts: dict[str, Any]) -> str:
    """One line for the page: whether a server repacks, from what its record says."""
    if "server_info_repack" in facts:  # Tributary
        fields = facts["server_info_repack"]
        said = next((v for v in fields.values() if isinstance(v, dict) and "enabled" in v), None)
        if said:  # /get_server_info's `weights_repack` (engine/repack.py)
            mib = said.get("repacked_mib") or 0.0
            return (
                f"{'on' if said['enabled'] else 'off'} (`--repack-weights "
                f"{said.get('setting')}`: {said.get('reason')}); "
                + (f"{mib:.1f} MiB of weights repacked" if mib else "nothing repacked")
            )
        shown = ", ".join(f"`{k}` = {json.dumps(v)}" for k, v in fields.items())
        return f"/get_server_info: {shown}" if fields else "/get_server_info says nothing of it"
    if "no_repack_flag" in facts:  # llama-server
        on = "off (`--no-repack`)" if facts["no_repack_flag"] else "on (llama-server's default)"
        mib = facts.get("probe", {}).get("repacked_mib")
        if mib is None:
            return f"{on}; the load log did not say what was repacked"
        if mib == 0:
            return f"{on}; nothing repacked: no tensor of this model fits CPU_REPACK"
        return f"{on}; {mib:.1f} MiB of weights repacked (CPU_REPACK buffer)"
    return "unknown"
