"""`just setup`'s last step: give .venv a llama.cpp compiled without AMX, from a wheel built
once per machine and kept outside the checkout.

    python3 bench/llama_wheel.py [--python .venv/bin/python] [--jobs N] [--force]

Standard library only. `pip install llama-cpp-python` compiles llama.cpp with
`GGML_NATIVE=ON`, so on a Xeon with AMX the library has AMX in it, and AMX's repacked weights
crash every decode (docs/architecture.md, "The AMX crash"): the engine then has to leave
weight repacking off, and with it the faster repacked kernels of Q4_0, Q4_K and IQ4_NL
weights. This script swaps that library for one built with the flags `bench/peers.py` builds
llama-server with (`LLAMA_CPP_FLAGS`: native, but `-mno-amx-*`):

- when the llama.cpp that `--python` imports reports no AMX (`AMX_INT8 = 1` absent from
  `llama_print_system_info`: a CPU without AMX, a CUDA build from `just setup-cuda`, or this
  script's own wheel), it does nothing;
- otherwise it installs the wheel cached in `~/.cache/tributary/wheels/<key>/`
  (`$TRIBUTARY_WHEEL_CACHE` overrides the folder), and first builds it there if it is
  missing: `pip wheel --no-binary llama-cpp-python --no-cache-dir` of the installed version,
  under `nice -n 19` (5-10 minutes on 2 cores). The key covers the version, the flags, the
  Python version and this CPU's model and flags (a `-march=native` build runs only on CPUs
  like the one it was built on), so a clean checkout's `just setup` (CI's) installs in
  seconds once any checkout on the machine has built it. `--no-cache-dir` keeps this build
  out of pip's own wheel cache, which `bench/peers.py setup-llama-cpp-server` reads.
- a build that fails (no network for the sdist, no compiler, a cache folder it cannot
  write) leaves .venv as it was, with a warning, and exits 0: the engine runs on the AMX
  build with its weights unrepacked, so `just setup` still finishes.

Installing swaps the library in seconds (`pip install --force-reinstall --no-deps`); the
build itself never touches .venv. The last line on stdout is the wheel installed (or
"unchanged"); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import LLAMA_CPP_FLAGS, PACKAGE, lib_has_amx, niced

REPO = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(f"[llama-wheel] {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    if folder := os.environ.get("TRIBUTARY_WHEEL_CACHE"):
        return Path(folder)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tributary" / "wheels"


def cpu_identity() -> dict[str, object]:
    """What a `-march=native` build depends on: the CPU's model and its flags."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name" and not model:
                    model = value
                elif key in ("flags", "Features") and not flags:
                    flags = value
                if model and flags:
                    break
    except OSError:
        pass
    return {"machine": platform.machine(), "model": model, "flags": sorted(flags.split())}


def venv_facts(python: Path) -> dict[str, str]:
    """The llama-cpp-python version and the Python version `python` has."""
    code = (
        "import importlib.metadata as m, json, sys; "
        f"print(json.dumps({{'version': m.version({PACKAGE!r}), "
        "'python': '%d.%d' % sys.version_info[:2]}))"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{python} has no {PACKAGE}: {out.stderr.strip().splitlines()[-1:]}")
    facts: dict[str, str] = json.loads(out.stdout)
    return facts


def wheel_dir(version: str, python_version: str) -> Path:
    """The cache folder for this version, flags, Python and CPU."""
    identity = {
        "version": version,
        "python": python_version,
        "cmake_flags": LLAMA_CPP_FLAGS,
        "cpu": cpu_identity(),
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / f"{PACKAGE}-{version}-noamx-{digest}"


def cached_wheel(folder: Path) -> Path | None:
    wheels = sorted(folder.glob("*.whl"))
    return wheels[0] if wheels else None


def build_wheel(python: Path, version: str, folder: Path, jobs: int) -> Path:
    """Compile llama-cpp-python `version` with AMX off into `folder` (atomically: a build
    that fails or is killed leaves no wheel behind)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["CMAKE_ARGS"] = " ".join(shlex.quote(flag) for flag in LLAMA_CPP_FLAGS)
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(jobs)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".building-"))
    try:
        cmd = niced(
            [
                str(python),
                "-m",
                "pip",
                "wheel",
                "--disable-pip-version-check",
                "--no-deps",
                # Keep this AMX-free build out of pip's wheel cache.
                "--no-cache-dir",
                "--no-binary",
                PACKAGE,
                f"{PACKAGE}=={version}",
                "-w",
                str(tmp),
            ]
        )
        log(f"compiling {PACKAGE} {version} with AMX off, {jobs} job(s), nice -n 19")
        log("$ CMAKE_ARGS=" + shlex.quote(env["CMAKE_ARGS"]) + " " + shlex.join(cmd))
        subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)
        if cached_wheel(tmp) is None:
            raise OSError(f"pip wheel left no {PACKAGE} {version} wheel in {tmp}")
        stamp = {
            "version": version,
            "cmake_flags": LLAMA_CPP_FLAGS,
            "cpu": cpu_identity(),
            "build_seconds": round(time.monotonic() - started, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / "build.json").write_text(json.dumps(stamp, indent=2) + "\n")
        shutil.rmtree(folder, ignore_errors=True)  # --force: the old build goes
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"built in {time.monotonic() - started:.0f} s: {folder}")
    wheel = cached_wheel(folder)
    assert wheel is not None
    return wheel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", type=Path, default=REPO / ".venv" / "bin" / "python")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--force", action="store_true", help="rebuild the wheel even if one is cached"
    )
    args = parser.parse_args()
    python: Path = args.python
    facts = venv_facts(python)  # exits when llama-cpp-python is not there
    if not args.force and not lib_has_amx(python):
        log(f"{python}'s llama.cpp has no AMX compiled in: nothing to do")
        print("unchanged")
        return
    folder = wheel_dir(facts["version"], facts["python"])
    wheel = None if args.force else cached_wheel(folder)
    if wheel is None:
        try:
            wheel = build_wheel(python, facts["version"], folder, args.jobs)
        except (OSError, subprocess.CalledProcessError) as exc:
            # The AMX build stays: it works, the engine just leaves the weights unrepacked.
            log(
                f"could not build the AMX-free wheel ({exc}); {python} keeps the llama.cpp "
                "with AMX, and Tributary loads weights unrepacked with it (one warning line)"
            )
            print("unchanged")
            return
    else:
        log(f"installing the AMX-free wheel built before: {wheel}")
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--force-reinstall",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        stdout=sys.stderr,
    )
    if lib_has_amx(python):
        sys.exit(f"{python}: llama.cpp still reports AMX_INT8 = 1 after installing {wheel}")
    print(wheel)


if __name__ == "__main__":
    main()
