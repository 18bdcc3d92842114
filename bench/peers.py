"""Build and set up the peer servers that `just bench-serving` measures Tributary against.

    python3 bench/peers.py build-llama-server [--version X] [--jobs N] [--force]
    python3 bench/peers.py setup-llama-cpp-server [--version X] [--jobs N] [--force]
    python3 bench/peers.py setup-aiperf [--version X] [--force]

Standard library only; runs with any python3. Everything lands in the git-ignored folder
`.bench-peers/` at the top of the repository and nothing there is ever committed:

- `build-llama-server` downloads the llama-cpp-python sdist of the version installed in `.venv`
  (or `--version`), unpacks it and builds only the `llama-server` target of its
  `vendor/llama.cpp` with cmake: Release, static, `GGML_NATIVE=ON` as llama-cpp-python's own
  build does by default, and AMX off. With `GGML_NATIVE=ON`, ggml passes `-march=native` and
  ignores its `GGML_AMX_*` options, so on a Xeon that has AMX the compiler would still define
  `__AMX_INT8__` and ggml would repack weights for AMX, which segfaults in
  `ggml_backend_amx_mul_mat` (see docs/llama-cpp-notes.md in the shared docs). Explicit
  `-mno-amx-*` flags win over `-march=native` in GCC and Clang whatever their order, so they
  go into CMAKE_C_FLAGS/CMAKE_CXX_FLAGS. The build runs under `nice -n 19` with `-j1` unless
  `--jobs` says otherwise. Result: `.bench-peers/llama-server-<version>/llama-server`.
- `setup-llama-cpp-server` creates `.bench-peers/llama-cpp-server-venv` and installs
  `llama-cpp-python[server]` of the same version into it. It installs the wheel pip built
  and cached for `.venv` when there is one (seconds instead of a ~5 minute compile), so both
  sides run the very same llama.cpp binary. When no cached wheel exists, or the one found was
  compiled with AMX, it compiles from the sdist with the same AMX-off flags.

- `setup-aiperf` creates `.bench-peers/aiperf-venv` with NVIDIA's `aiperf` (the established
  client `just bench-crosscheck` checks `tributary bench` against) and writes a Hugging Face
  tokenizer for it to `.bench-peers/smollm2-tokenizer`, built from the GGUF's own vocabulary
  and merges (nothing is downloaded; see AIPERF_TOKENIZER_SCRIPT). Result: the venv's python.

Each step is idempotent: a stamp file records what was built, and a second run with the same
version prints the path and does nothing else. The last line on stdout is the path (the
binary, or the venv's python); progress goes to stderr, so a recipe can capture the path with
`$(python3 bench/peers.py build-llama-server)`.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".bench-peers"
MAIN_VENV_PYTHON = REPO / ".venv" / "bin" / "python"
PACKAGE = "llama-cpp-python"

# Explicit -mno-* flags take precedence over -march=native in GCC and Clang.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

# Flags shared by the llama-server build and a from-source llama-cpp-python build.
LLAMA_CPP_FLAGS = [
    "-DGGML_NATIVE=ON",
    # Only read when GGML_NATIVE=OFF; set anyway so a non-native build is AMX-free too.
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}",
]

LLAMA_SERVER_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    *LLAMA_CPP_FLAGS,
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    # No HTTPS needed for a local benchmark; one system dependency fewer.
    "-DLLAMA_OPENSSL=OFF",
    # The web UI would be downloaded from a Hugging Face bucket or built with npm: skip it.
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
]


def log(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    log("$ " + shlex.join(cmd))
    # Children write to stderr too: stdout carries only the resulting path.
    subprocess.run(cmd, check=True, env=env, cwd=cwd, stdout=sys.stderr)


def niced(cmd: list[str]) -> list[str]:
    nice = shutil.which("nice")
    return [nice, "-n", "19", *cmd] if nice else cmd


def installed_version() -> str:
    """The llama-cpp-python version in the repository's .venv."""
    return in_main_venv(
        f"import importlib.metadata as m; print(m.version({PACKAGE!r}))", "or pass --version"
    )


def in_main_venv(code: str, hint: str = "") -> str:
    """What `code`, run by the repository's .venv python, prints."""
    if not MAIN_VENV_PYTHON.exists():
        sys.exit(f"{MAIN_VENV_PYTHON} not found: run `just setup` first {hint}".rstrip())
    out = subprocess.run(
        [str(MAIN_VENV_PYTHON), "-c", code], check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def pip_python() -> str:
    """A python that has pip: the repository's .venv when there is one."""
    if MAIN_VENV_PYTHON.exists():
        return str(MAIN_VENV_PYTHON)
    return sys.executable


def read_stamp(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_stamp(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def machine() -> dict[str, object]:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def fetch_sdist(version: str) -> Path:
    """Download the sdist into the cache (once) and unpack it (once); returns the source root."""
    sdist_dir = CACHE / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{version}"
    tarball = sdist_dir / f"{name}.tar.gz"
    if not tarball.exists():
        log(f"downloading the {PACKAGE} {version} sdist")
        run(
            [
                pip_python(),
                "-m",
                "pip",
                "download",
                "--no-binary",
                ":all:",
                "--no-deps",
                "--disable-pip-version-check",
                f"{PACKAGE}=={version}",
                "-d",
                str(sdist_dir),
            ]
        )
    if not tarball.exists():
        sys.exit(f"pip download did not produce {tarball}")
    src = CACHE / "src" / name
    if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        log(f"unpacking {tarball.name}")
        src.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=src.parent) as tmp, tarfile.open(tarball) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, filter="data")
            else:  # Python < 3.11.4
                tar.extractall(tmp)
            unpacked = Path(tmp) / name
            if not unpacked.is_dir():
                sys.exit(f"{tarball} does not contain {name}/")
            if src.exists():
                shutil.rmtree(src)
            unpacked.rename(src)
    return src


def llama_cpp_commit(src: Path) -> str | None:
    """The llama.cpp commit vendored in the sdist, when its git metadata came along."""
    llama_dir = src / "vendor" / "llama.cpp"
    if not (llama_dir / ".git").exists() or not shutil.which("git"):
        return None
    out = subprocess.run(
        ["git", "-C", str(llama_dir), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() if out.returncode == 0 else None


def build_llama_server(args: argparse.Namespace) -> Path:
    version = args.version or installed_version()
    out_dir = CACHE / f"llama-server-{version}"
    binary = out_dir / "llama-server"
    stamp_path = out_dir / "build.json"
    stamp = read_stamp(stamp_path)
    if (
        not args.force
        and binary.exists()
        and stamp is not None
        and stamp.get("version") == version
        and stamp.get("cmake_flags") == LLAMA_SERVER_FLAGS
    ):
        log(f"llama-server for {PACKAGE} {version} already built")
        return binary

    started = time.monotonic()
    src = fetch_sdist(version)
    llama_dir = src / "vendor" / "llama.cpp"
    build_dir = out_dir / "build"
    out_dir.mkdir(parents=True, exist_ok=True)

    configure = ["cmake", "-S", str(llama_dir), "-B", str(build_dir)]
    if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
        configure += ["-G", "Ninja"]
    configure += LLAMA_SERVER_FLAGS
    log("configuring llama.cpp")
    t0 = time.monotonic()
    run(niced(configure))
    configure_s = time.monotonic() - t0

    log(f"building llama-server with {args.jobs} job(s) under nice -n 19")
    t0 = time.monotonic()
    run(
        niced(
            [
                "cmake",
                "--build",
                str(build_dir),
                "--config",
                "Release",
                "--target",
                "llama-server",
                "-j",
                str(args.jobs),
            ]
        )
    )
    build_s = time.monotonic() - t0

    built = build_dir / "bin" / "llama-server"
    if not built.exists():
        sys.exit(f"the build finished but {built} is missing")
    tmp = binary.with_suffix(".tmp")
    shutil.copy2(built, tmp)
    tmp.replace(binary)
    write_stamp(
        stamp_path,
        {
            "version": version,
            "llama_cpp_commit": llama_cpp_commit(src),
            "cmake_flags": LLAMA_SERVER_FLAGS,
            "jobs": args.jobs,
            "configure_seconds": round(configure_s, 1),
            "build_seconds": round(build_s, 1),
            "total_seconds": round(time.monotonic() - started, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(),
        },
    )
    log(f"built in {time.monotonic() - started:.0f} s (compile {build_s:.0f} s)")
    return binary


def cached_wheels(version: str) -> list[Path]:
    """Wheels of this version in pip's wheel cache (built for .venv by `pip install`)."""
    out = subprocess.run(
        [
            pip_python(),
            "-m",
            "pip",
            "cache",
            "list",
            "llama_cpp_python",
            "--format=abspath",
            "--disable-pip-version-check",
        ],
        capture_output=True,
        text=True,
    )
    prefix = f"llama_cpp_python-{version}-"
    paths = [Path(line.strip()) for line in out.stdout.splitlines() if line.strip()]
    return [p for p in paths if p.name.startswith(prefix) and p.suffix == ".whl" and p.exists()]


def lib_has_amx(python: Path) -> bool:
    """Whether the llama.cpp that `python` imports was compiled with AMX."""
    out = subprocess.run(
        [
            str(python),
            "-c",
            "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())",
        ],
        capture_output=True,
        text=True,
    )
    return "AMX_INT8 = 1" in out.stdout


def lib_digest(python: Path) -> str | None:
    """sha256 of the libggml-cpu that `python` imports (to tell whether two venvs share it)."""
    out = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util, os; "
            "print(os.path.dirname(importlib.util.find_spec('llama_cpp').origin))",
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        return None
    libs = sorted(glob.glob(os.path.join(out.stdout.strip(), "lib", "libggml-cpu.so*")))
    if not libs:
        return None
    return hashlib.sha256(Path(libs[0]).read_bytes()).hexdigest()


def make_venv(venv: Path, args: argparse.Namespace) -> list[str]:
    """Create `venv` (again, with --force) with an up-to-date pip; returns its pip command."""
    python = venv / "bin" / "python"
    if args.force and venv.exists():
        shutil.rmtree(venv)
    if not python.exists():
        # The base interpreter of .venv when there is one: pip keys its wheel cache by
        # interpreter version too, and a peer should run on the same Python as Tributary.
        base = args.python or _base_python()
        log(f"creating {venv} with {base}")
        run([base, "-m", "venv", str(venv)])
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    run([*pip, "install", "--quiet", "--upgrade", "pip"])
    return pip


def setup_llama_cpp_server(args: argparse.Namespace) -> Path:
    version = args.version or installed_version()
    venv = CACHE / "llama-cpp-server-venv"
    python = venv / "bin" / "python"
    stamp_path = venv / "peers.json"
    stamp = read_stamp(stamp_path)
    if not args.force and python.exists() and stamp is not None and stamp.get("version") == version:
        check = subprocess.run([str(python), "-c", "import llama_cpp.server.app"])
        if check.returncode == 0:
            log(f"{venv} already has {PACKAGE}[server] {version}")
            return python

    started = time.monotonic()
    pip = make_venv(venv, args)

    how = "source"
    wheels = [] if args.from_source else cached_wheels(version)
    if wheels:
        log(f"installing the wheel pip cached for .venv: {wheels[0]}")
        run([*pip, "install", f"{PACKAGE}[server] @ {wheels[0].as_uri()}"])
        how = f"cached wheel {wheels[0].name}"
        if lib_has_amx(python):
            log("the cached wheel was compiled with AMX (it segfaults here): rebuilding")
            wheels = []
    if not wheels:
        log(f"compiling {PACKAGE} {version} with AMX off, {args.jobs} job(s), nice -n 19")
        subprocess.run([*pip, "uninstall", "--yes", "--quiet", PACKAGE], check=False)
        env = dict(os.environ)
        env["CMAKE_ARGS"] = " ".join(shlex.quote(flag) for flag in LLAMA_CPP_FLAGS)
        env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(args.jobs)
        run(
            niced(
                [
                    *pip,
                    "install",
                    # Keep this AMX-free build out of pip's cache: .venv reinstalls from there.
                    "--no-cache-dir",
                    "--no-binary",
                    PACKAGE,
                    f"{PACKAGE}[server]=={version}",
                ]
            ),
            env=env,
        )
        how = "compiled from the sdist with AMX off"
    if lib_has_amx(python):
        sys.exit(f"{venv}: llama.cpp still reports AMX_INT8 = 1")
    same = MAIN_VENV_PYTHON.exists() and lib_digest(python) == lib_digest(MAIN_VENV_PYTHON)
    elapsed = time.monotonic() - started
    write_stamp(
        stamp_path,
        {
            "version": version,
            "installed_from": how,
            "same_llama_cpp_binary_as_dot_venv": same,
            "seconds": round(elapsed, 1),
            "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(),
        },
    )
    log(
        f"{PACKAGE}[server] {version} installed ({how}) in {elapsed:.0f} s"
        f"{' (same libggml-cpu as .venv)' if same else ''}"
    )
    return python


AIPERF_VERSION = "0.13.0"

#: Run by the aiperf venv's python: argv[1] the GGUF, argv[2] the output folder. transformers
#: 5 reads GGUF metadata with torch (`AutoTokenizer.from_pretrained(dir, gguf_file=...)` fails
#: without it), so the metadata is read with the `gguf` package and handed to transformers' own
#: GGUF tokenizer builders. Their pre-tokenizer table has no entry for llama.cpp's "smollm"
#: type, which splits digits one by one before the GPT-2 split (llama-vocab.cpp,
#: LLAMA_VOCAB_PRE_TYPE_SMOLLM, and SmolLM2's own tokenizer.json); that one is set here.
AIPERF_TOKENIZER_SCRIPT = """
import sys
from gguf import GGUFReader
from tokenizers import pre_tokenizers
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_TOKENIZER_MAPPING, add_gguf_special_tokens, select_tokenizer_builder, set_split_regex)

path, out = sys.argv[1], sys.argv[2]
fields = GGUFReader(path).fields
meta = {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")}
arch = fields["general.architecture"].contents()
names = GGUF_TOKENIZER_MAPPING["tokenizer"]
spec = {n: meta["tokenizer." + k] for k, n in names.items() if "tokenizer." + k in meta}
tok = select_tokenizer_builder(arch, spec.get("tokenizer_type"))(spec)
tok = set_split_regex(add_gguf_special_tokens(tok, spec), spec)
if spec.get("pre_tokenizer_type") == "smollm":
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
for name in ("bos", "eos", "unk", "pad"):
    if name + "_token_id" in spec:
        setattr(tok, name + "_token", spec["tokens"][spec[name + "_token_id"]])
tok.save_pretrained(out)
print(out)
"""


def setup_aiperf(args: argparse.Namespace) -> Path:
    version = args.version or AIPERF_VERSION
    venv = CACHE / "aiperf-venv"
    python = venv / "bin" / "python"
    tokenizer = CACHE / "smollm2-tokenizer"
    stamp_path = venv / "peers.json"
    stamp = read_stamp(stamp_path)
    gguf = _default_gguf()
    if (
        not args.force
        and python.exists()
        and stamp is not None
        and stamp.get("version") == version
        and stamp.get("gguf") == str(gguf)
        and (tokenizer / "tokenizer.json").exists()
    ):
        log(f"{venv} already has aiperf {version}; tokenizer in {tokenizer}")
        return python
    started = time.monotonic()
    pip = make_venv(venv, args)
    run([*pip, "install", "--quiet", f"aiperf=={version}", "gguf"])
    log(f"building a tokenizer from {gguf.name}")
    run([str(python), "-c", AIPERF_TOKENIZER_SCRIPT, str(gguf), str(tokenizer)])
    write_stamp(
        stamp_path,
        {
            "version": version,
            "gguf": str(gguf),
            "tokenizer": str(tokenizer),
            "seconds": round(time.monotonic() - started, 1),
            "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(),
        },
    )
    return python


def _default_gguf() -> Path:
    """The model `tributary serve` loads by default (engine/runners/llama/loading.py)."""
    return Path(
        in_main_venv(
            "from tributary.engine.runners.llama import default_model_path as d; print(d())"
        )
    )


def _base_python() -> str:
    if MAIN_VENV_PYTHON.exists():
        out = subprocess.run(
            [str(MAIN_VENV_PYTHON), "-c", "import sys; print(sys._base_executable)"],
            capture_output=True,
            text=True,
        )
        base = out.stdout.strip()
        if out.returncode == 0 and base and Path(base).exists():
            return base
    return shutil.which("python3") or sys.executable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("build-llama-server", "build llama.cpp's llama-server from the sdist's vendor/llama.cpp"),
        ("setup-llama-cpp-server", "a venv with llama-cpp-python[server] for llama_cpp.server"),
        ("setup-aiperf", "a venv with aiperf and a tokenizer built from the GGUF"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "--version",
            help=f"aiperf version (default {AIPERF_VERSION})"
            if name == "setup-aiperf"
            else f"{PACKAGE} version (default: the one installed in .venv)",
        )
        p.add_argument("--jobs", type=int, default=1, help="parallel compile jobs (default 1)")
        p.add_argument("--force", action="store_true", help="redo the step even if cached")
        if name != "build-llama-server":
            p.add_argument("--python", help="interpreter for the venv (default: .venv's base)")
        if name == "setup-llama-cpp-server":
            p.add_argument(
                "--from-source",
                action="store_true",
                help="compile llama-cpp-python instead of reusing pip's cached wheel",
            )
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.command == "build-llama-server":
        path = build_llama_server(args)
    elif args.command == "setup-aiperf":
        path = setup_aiperf(args)
    else:
        path = setup_llama_cpp_server(args)
    print(path)


if __name__ == "__main__":
    main()
