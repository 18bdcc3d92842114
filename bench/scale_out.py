"""A Tributary front over workers next to a worker served directly (issue 13's benchmark).

Every server is a subprocess on loopback, measured by `tributary bench` (a separate process)
with fixed seeds, one configuration after the other in one run:

1. **Added latency** (sim runner at its default `SimLatency`, 8 running slots a worker,
   concurrency 16, streaming `/generate`): one worker directly; a front over that one worker
   (same capacity, so the difference is what the front adds); a front over two workers
   (round robin). E2E and TTFT p50 / p99, requests/s.
2. **Throughput ceiling** (zero-cost sim workers: `SimLatency(0, 0, 0)`, 64 running slots,
   concurrency 64, short streams): one worker directly; a front over it; a front over two.
   Requests/s, and the CPU seconds per request of the front process and of the workers
   (`/proc` utime + stime over the measured run, warm-up included in the divisor).
3. **OpenAI upstream kind** against llama.cpp's `llama-server` when it is built (under
   `.bench-peers/`, here or in the main worktree): llama-server directly against a front
   (`--worker-kind openai`) over it, concurrency 4, a small streaming `/v1/completions` run:
   output tokens/s and TTFT. Each of the two runs gets a freshly started llama-server, so
   neither finds the other's prompts in llama-server's prompt cache.

Writes docs/benchmarks/scale-out.json (every run's `tributary bench` summary, the CPU
figures, the machine and load) and scale-out.md (machine, commands, table, a short reading
kept between the `<!-- notes -->` markers).

    .venv/bin/python bench/scale_out.py            # the full run, 4-8 minutes (the machine's load)
    .venv/bin/python bench/scale_out.py --quick    # a smoke run, under a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from page_notes import NOTES_END, NOTES_START, commands_section, existing_notes
from serving import (
    DOCS,
    NO_KEEPALIVE_CLIENT,
    REPO,
    VENV_BIN,
    Server,
    ServerSpec,
    free_port,
    loadavg,
    machine_info,
    model_path,
)

SEED = 13

#: `tributary serve` with the sim runner at zero cost and 64 running slots (there is no flag
#: for the sim's latency model): the CLI's own configs, with `sim_latency` replaced.
ZERO_COST_SERVE = (
    "import dataclasses, sys; from tributary.app import cli; "
    "from tributary.engine import SimLatency; "
    "zero = SimLatency(step_base=0, decode_per_seq=0, prefill_per_token=0); "
    "orig = cli.configs; "
    "cli.configs = lambda a: (dataclasses.replace(orig(a)[0], sim_latency=zero), orig(a)[1]); "
    "sys.exit(cli.main(sys.argv[1:]))"
)


def server(name: str, argv: list[str], logs: Path) -> Server:
    """A server to start on a free loopback port (`{port}` in `argv`), ready at /health."""
    port = free_port()
    filled = [a.replace("{port}", str(port)) for a in argv]
    made = Server(ServerSpec(name, argv, "/health"), filled, logs / f"{name}.log")
    made.url = f"http://127.0.0.1:{port}"
    return made


def sim_worker(name: str, logs: Path, *, zero: bool) -> Server:
    serve = ["serve", "--runner", "sim", "--host", "127.0.0.1", "--port", "{port}"]
    serve += ["--log-level", "warning"]
    if zero:
        argv = [str(VENV_BIN / "python"), "-c", ZERO_COST_SERVE, *serve]
        argv += ["--max-running-requests", "64"]
    else:
        argv = [str(VENV_BIN / "tributary"), *serve]
    return server(name, argv, logs)


def front(name: str, logs: Path, workers: list[Server], kind: str = "sglang") -> Server:
    argv = [str(VENV_BIN / "tributary"), "serve", "--host", "127.0.0.1", "--port", "{port}"]
    argv += ["--log-level", "warning", "--policy", "round_robin", "--worker-kind", kind]
    for w in workers:
        argv += ["--worker-url", w.url]
    return server(name, argv, logs)


@dataclasses.dataclass
class Workload:
    backend: str
    concurrency: int
    num_prompts: int
    warmup: int
    input_len: int
    output_len: int


def bench_argv(url: str, tokenizer: str, wl: Workload, out: Path, label: str) -> list[str]:
    return [
        "bench",
        "--base-url",
        url,
        "--backend",
        wl.backend,
        "--tokenizer-from",
        tokenizer,
        "--seed",
        str(SEED),
        "--num-prompts",
        str(wl.num_prompts),
        "--warmup",
        str(wl.warmup),
        "--concurrency",
        str(wl.concurrency),
        "--input-len",
        str(wl.input_len),
        "--output-len",
        str(wl.output_len),
        "--timeout",
        "300",
        "--no-progress",
        "--label",
        label,
        "--output-json",
        str(out),
    ]


KEYS = (
    "completed",
    "failed",
    "failure_reasons",
    "retried",
    "duration",
    "request_throughput",
    "output_throughput",
    "median_e2e_latency_ms",
    "p99_e2e_latency_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "client_cpu_load",
)


def measure(
    section: str,
    label: str,
    target: Server,
    tokenizer: Server,
    wl: Workload,
    tmp: Path,
    watch: dict[str, Server],
    *,
    keepalive: bool = True,
) -> dict[str, Any]:
    """One `tributary bench` run against `target`; the CPU of each process in `watch`."""
    out = tmp / f"{section}-{label.replace(' ', '_')}.json"
    client = (
        [str(VENV_BIN / "tributary")]
        if keepalive
        else [str(VENV_BIN / "python"), "-c", NO_KEEPALIVE_CLIENT]
    )
    argv = [*client, *bench_argv(target.url, tokenizer.url, wl, out, label)]
    before = {k: s.cpu_seconds() for k, s in watch.items()}
    proc = subprocess.run(argv, capture_output=True, text=True)
    after = {k: s.cpu_seconds() for k, s in watch.items()}
    if proc.returncode not in (0, 1) or not out.exists():
        sys.exit(f"tributary bench failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(out.read_text())
    requests = wl.num_prompts + wl.warmup
    record = {k: result.get(k) for k in KEYS}
    record |= {"section": section, "label": label, "workload": dataclasses.asdict(wl)}
    record["cpu_ms_per_request"] = {k: 1000 * (after[k] - before[k]) / requests for k in watch}
    # The command as a reader would type it (servers' ports differ each run).
    shown = shlex.join(["tributary", *argv[len(client) :]]).replace(str(tmp) + "/", "")
    if not keepalive:
        shown += "  # connections never reused (serving.py's NO_KEEPALIVE_CLIENT)"
    record["command"] = shown
    print(
        f"  {section:<8} {label:<34} {fmt(record['request_throughput'], '.2f'):>8} req/s  "
        f"e2e p50 {fmt(record['median_e2e_latency_ms'])} p99 {fmt(record['p99_e2e_latency_ms'])}"
        f"  ttft p50 {fmt(record['median_ttft_ms'])} p99 {fmt(record['p99_ttft_ms'])}  "
        f"failed {record['failed']}",
        flush=True,
    )
    return record


def fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def llama_setup() -> tuple[Path, Path] | None:
    """(llama-server, model) when llama-server is built here or in the main worktree."""
    common = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--path-format=absolute", "--git-common-dir"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    roots = [REPO / ".bench-peers"]
    if common:
        roots.append(Path(common).parent / ".bench-peers")
    found = [b for root in roots for b in sorted(root.glob("llama-server-*/llama-server"))]
    if not found:
        return None
    try:
        model = model_path()
    except subprocess.CalledProcessError:
        return None
    if not model.exists():
        return None
    return found[-1], model


def run(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    latency = Workload("generate", 16, 16 if q else 160, 4 if q else 16, 64, 32)
    ceiling = Workload("generate", 64, 128 if q else 2000, 16 if q else 64, 16, 16)
    llama_wl = Workload("openai", 4, 4 if q else 16, 1 if q else 4, 64, 64)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="scale-out-") as tmpname:
        tmp = Path(tmpname)
        servers: list[Server] = []

        def started(s: Server) -> Server:
            servers.append(s)
            s.start(int(s.url.rsplit(":", 1)[1]))
            return s

        try:
            print("added latency: sim runner, default SimLatency, concurrency 16", flush=True)
            w1 = started(sim_worker("worker-1", tmp, zero=False))
            w2 = started(sim_worker("worker-2", tmp, zero=False))
            f1 = started(front("front-1", tmp, [w1]))
            f2 = started(front("front-2", tmp, [w1, w2]))
            cases = [("one worker, directly", w1), ("front over that worker", f1)]
            cases.append(("front over two workers", f2))
            for label, target in cases:
                watch = {"front": target, "workers": w1} if target is f1 else {"target": target}
                records.append(measure("latency", label, target, w1, latency, tmp, watch))
            for s in (f2, f1, w2, w1):
                s.stop()

            print("throughput ceiling: zero-cost sim workers, concurrency 64", flush=True)
            z1 = started(sim_worker("zero-1", tmp, zero=True))
            z2 = started(sim_worker("zero-2", tmp, zero=True))
            g1 = started(front("zero-front-1", tmp, [z1]))
            g2 = started(front("zero-front-2", tmp, [z1, z2]))
            records.append(
                measure("ceiling", "one worker, directly", z1, z1, ceiling, tmp, {"worker": z1})
            )
            records.append(
                measure(
                    "ceiling",
                    "front over that worker",
                    g1,
                    z1,
                    ceiling,
                    tmp,
                    {"front": g1, "worker": z1},
                )
            )
            records.append(
                measure(
                    "ceiling",
                    "front over two workers",
                    g2,
                    z1,
                    ceiling,
                    tmp,
                    {"front": g2, "worker 1": z1, "worker 2": z2},
                )
            )
            for s in (g2, g1, z2, z1):
                s.stop()

            setup = None if args.no_llama else llama_setup()
            llama: dict[str, Any] = {"built": setup is not None}
            if setup is not None:
                binary, model = setup
                llama |= {"binary": str(binary), "model": model.name}
                print("openai upstream: llama-server, concurrency 4", flush=True)
                argv = [str(binary), "-m", str(model), "-t", "2", "-tb", "2", "-np", "4"]
                argv += ["-c", "8192", "--host", "127.0.0.1", "--port", "{port}"]
                # A fresh llama-server for each run: the same prompts would otherwise hit
                # the first run's prompt cache in the second.
                ls = started(server("llama-server", argv, tmp))
                records.append(
                    measure(
                        "openai",
                        "llama-server, directly",
                        ls,
                        ls,
                        llama_wl,
                        tmp,
                        {"llama-server": ls},
                        keepalive=False,
                    )
                )
                ls.stop()
                ls = started(server("llama-server-2", argv, tmp))
                lf = started(front("llama-front", tmp, [ls], kind="openai"))
                records.append(
                    measure(
                        "openai",
                        "front over llama-server",
                        lf,
                        ls,
                        llama_wl,
                        tmp,
                        {"front": lf, "llama-server": ls},
                    )
                )
        finally:
            for s in reversed(servers):
                s.stop()
    return {"records": records, "llama_server": llama}


def render(doc: dict[str, Any], notes: str) -> str:
    recs = doc["records"]
    lines = [
        "# Scale-out: a front over workers against a worker served directly",
        "",
        "Generated by `just bench-scale-out` (`bench/scale_out.py`); the reading between the",
        "notes markers is hand-written and kept when the page is regenerated. See",
        "[scale-out.md](../scale-out.md) for the front itself.",
        "",
        f"Run {doc['date']} on {doc['machine']['cpu']} ({doc['machine']['cores']} cores), "
        f"commit `{doc['commit'][:12]}`; load average {doc['load_before']} before, "
        f"{doc['load_after']} after; {doc['wall_seconds']:.0f} s in all. The machine is shared: "
        "single runs move by 10-40%.",
        "",
        "## Added latency (sim runner, default SimLatency, concurrency 16)",
        "",
        "| Served by | req/s | E2E p50 (ms) | E2E p99 (ms) | TTFT p50 (ms) | TTFT p99 (ms) "
        "| failed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    row = "| {label} | {rps} | {e50} | {e99} | {t50} | {t99} | {failed} |"

    def cells(r: dict[str, Any]) -> dict[str, Any]:
        return {
            "label": r["label"],
            "rps": fmt(r["request_throughput"], ".2f"),
            "e50": fmt(r["median_e2e_latency_ms"], ",.0f"),
            "e99": fmt(r["p99_e2e_latency_ms"], ",.0f"),
            "t50": fmt(r["median_ttft_ms"], ",.1f"),
            "t99": fmt(r["p99_ttft_ms"], ",.1f"),
            "failed": r["failed"],
            "tps": fmt(r["output_throughput"], ",.1f"),
        }

    lat = [r for r in recs if r["section"] == "latency"]
    lines += [row.format(**cells(r)) for r in lat]
    if len(lat) >= 2:
        d, f = lat[0], lat[1]
        lines += [
            "",
            "The front's added latency (front over the one worker minus that worker directly): "
            f"E2E p50 {fmt(f['median_e2e_latency_ms'] - d['median_e2e_latency_ms'], '+.1f')} ms, "
            f"p99 {fmt(f['p99_e2e_latency_ms'] - d['p99_e2e_latency_ms'], '+.1f')} ms; "
            f"TTFT p50 {fmt(f['median_ttft_ms'] - d['median_ttft_ms'], '+.1f')} ms, "
            f"p99 {fmt(f['p99_ttft_ms'] - d['p99_ttft_ms'], '+.1f')} ms.",
        ]
    lines += [
        "",
        "## Throughput ceiling (zero-cost sim workers, concurrency 64)",
        "",
        "| Served by | req/s | vs directly | E2E p50 (ms) | E2E p99 (ms) | CPU ms per request "
        "| failed |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    ceil = [r for r in recs if r["section"] == "ceiling"]
    base = ceil[0]["request_throughput"] if ceil else None
    for r in ceil:
        c = cells(r)
        ratio = r["request_throughput"] / base if base else None
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_request"].items())
        lines.append(
            f"| {c['label']} | {c['rps']} | {fmt(ratio, '.2f')} | {c['e50']} | {c['e99']} "
            f"| {cpu} | {c['failed']} |"
        )
    lines += ["", "## OpenAI upstream kind: llama.cpp's server (concurrency 4)", ""]
    oa = [r for r in recs if r["section"] == "openai"]
    if oa:
        lines += [
            f"`{doc['llama_server'].get('binary', '')}` on `{doc['llama_server'].get('model')}`, "
            "2 threads, 4 slots.",
            "",
            "| Served by | output tok/s | req/s | TTFT p50 (ms) | TTFT p99 (ms) | E2E p50 (ms) "
            "| failed |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in oa:
            c = cells(r)
            lines.append(
                f"| {c['label']} | {c['tps']} | {c['rps']} | {c['t50']} | {c['t99']} "
                f"| {c['e50']} | {c['failed']} |"
            )
    else:
        lines.append(
            "llama-server is not built here (`python3 bench/peers.py build-llama-server`)."
        )
    lines += ["", "## Reading it", "", NOTES_START, notes.strip(), NOTES_END, ""]
    lines += commands_section("just bench-scale-out", "bench/scale_out.py", doc["argv"])[:-2]
    lines += [
        "# servers (ports chosen at run time):",
        "tributary serve --runner sim --port W1        # and W2; zero-cost: the CLI with "
        "SimLatency(0, 0, 0), --max-running-requests 64 (ZERO_COST_SERVE in the script)",
        "tributary serve --port F --policy round_robin --worker-url http://127.0.0.1:W1 "
        "[--worker-url http://127.0.0.1:W2] [--worker-kind openai]",
        "llama-server -m MODEL -t 2 -tb 2 -np 4 -c 8192 --port L",
        "",
        "# clients, one after the other:",
    ]
    lines += [r["command"] for r in recs]
    lines += ["```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, under a minute")
    parser.add_argument("--no-llama", action="store_true", help="skip llama-server")
    parser.add_argument("--out-dir", type=Path, default=DOCS)
    args = parser.parse_args()
    t0 = time.monotonic()
    load_before = loadavg()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    result = run(args)
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    doc = {
        "date": date,
        "argv": " ".join(sys.argv[1:]),
        "machine": machine_info(),
        "commit": commit,
        "load_before": load_before,
        "load_after": loadavg(),
        "wall_seconds": time.monotonic() - t0,
        **result,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    md_path = args.out_dir / "scale-out.md"
    notes = existing_notes(md_path) or "(no reading yet)"
    (args.out_dir / "scale-out.json").write_text(json.dumps(doc, indent=1) + "\n")
    md_path.write_text(render(doc, notes))
    print(f"wrote {args.out_dir / 'scale-out.json'} and {md_path} in {doc['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
