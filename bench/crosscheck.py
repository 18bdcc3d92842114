"""`tributary bench` against an established client, NVIDIA's aiperf, on the same workload.

    .venv/bin/python bench/crosscheck.py [--rounds 2] [--levels 4:40 1:12] [--threads 2]

(`just bench-crosscheck` first sets up aiperf with `bench/peers.py setup-aiperf`: its own venv
in `.bench-peers/aiperf-venv`, and a Hugging Face tokenizer built from the GGUF in
`.bench-peers/smollm2-tokenizer`.) Starts one Tributary server as bench/serving.py does
(`tributary serve --threads 2 --max-running-requests 16 --context-length 8192`), builds every
prompt once with the server's tokenizer (input length 128 by default), and then, for each
round and each concurrency, measures streaming `/v1/completions` with both clients back to
back, the order alternating each round so that drift on this shared machine hits both alike:

- `tributary bench --backend openai --load-prompts FILE --concurrency C --warmup W ...`
- `aiperf profile --endpoint-type completions --streaming --input-file FILE.jsonl
  --custom-dataset-type single_turn --dataset-sampling-strategy sequential
  --warmup-request-count W --request-count N --concurrency C
  --extra-inputs '{"ignore_eos": true, "temperature": 0}' --tokenizer DIR ...`

Then the same with the sim runner (`--sim-rounds`, default 1): a stand-in model whose steps
sleep instead of computing, so the server's speed does not depend on the CPU the client leaves
it. On a 2-core machine the clients' own CPU use differs a lot (aiperf runs as seven
processes: system controller, dataset, timing, worker and records managers, a worker and a
record processor), and with the real model that changes what is being measured; against the
sim runner only the measuring is compared.

Both send the same request body: prompt, `max_tokens` 64, `temperature` 0, `ignore_eos`,
`stream`, `stream_options.include_usage`. Every measurement gets prompts no other one has
seen (the aiperf file lists its warm-up prompts first; sequential sampling carries on from
warm-up into the measured phase). Each client runs as its own process, as a user runs it.

And tributary bench's own stream parser and report are fed the SSE events aiperf recorded
for its measured requests (aiperf's raw export keeps every event with the time it was read):
the same events through both clients' arithmetic, so what is left is only how each defines
a figure.

The tokenizer aiperf counts with is checked against the model's own (Tributary's `/tokenize`)
on every prompt and every output text aiperf received: same token ids, or the differences
are listed.

Writes docs/benchmarks/crosscheck.json (both clients' summaries per measurement, the figures
compared with their per-round ratios, the tokenizer check; no per-request records) and
crosscheck.md
(the table with per-metric ratios, the machine, the exact commands), keeping the hand-written
notes between the `<!-- notes -->` markers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from page_notes import NOTES_END, NOTES_START, existing_notes, summary_json
from serving import (
    PEERS,
    REPO,
    VENV_BIN,
    LoadProbe,
    Server,
    ServerSpec,
    bench_arguments,
    code_state,
    free_port,
    loadavg,
    machine_info,
    own_cpu,
    proc_cpu,
)

DOCS = REPO / "docs" / "benchmarks"
AIPERF_VENV = PEERS / "aiperf-venv"
TOKENIZER_DIR = PEERS / "smollm2-tokenizer"
WORK = PEERS / "crosscheck"

#: Run by the aiperf venv's python: token ids of each text of a JSON list (argv[2]) with the
#: tokenizer in argv[1], as aiperf counts them (`tokenizer.encode(text)`; this tokenizer adds
#: no special tokens, the GGUF says add_bos_token false).
HF_TOKENIZE = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
texts = json.load(open(sys.argv[2]))
json.dump([tok.encode(t) for t in texts], sys.stdout)
"""


@dataclasses.dataclass(frozen=True)
class Level:
    concurrency: int
    num_prompts: int
    warmup: int


def parse_level(text: str) -> Level:
    c, _, n = text.partition(":")
    concurrency = int(c)
    num = int(n) if n else 12 * concurrency
    return Level(concurrency, num, max(concurrency, 2))


# -- the two clients ---------------------------------------------------------------------------


def run_tributary_bench(
    server: Server, lv: Level, prompts_file: Path, output_len: int, out: Path
) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    argv = [
        str(VENV_BIN / "tributary"),
        *bench_arguments(server.url, "openai", prompts_file, lv, output_len, out, timeout=900),
    ]
    run = _timed_run(argv, server)
    if run.proc.returncode not in (0, 1) or not out.exists():
        raise RuntimeError(f"tributary bench failed ({run.proc.returncode}): {run.proc.stderr}")
    result = json.loads(out.read_text())
    # The measured window ends when the last request does; writing the report takes a few ms.
    window = run.cores(run.exited - result["duration"], run.exited)
    return result, argv, window | {"measured_s": result["duration"]}


def run_aiperf(
    server: Server, model: str, lv: Level, jsonl: Path, output_len: int, out_dir: Path, seed: int
) -> tuple[dict[str, Any], list[dict[str, Any]], list[str], dict[str, Any]]:
    argv = [
        str(AIPERF_VENV / "bin" / "aiperf"),
        "profile",
        "--model",
        model,
        "--url",
        server.url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--input-file",
        str(jsonl),
        "--custom-dataset-type",
        "single_turn",
        "--dataset-sampling-strategy",
        "sequential",
        "--warmup-request-count",
        str(lv.warmup),
        "--request-count",
        str(lv.num_prompts),
        "--concurrency",
        str(lv.concurrency),
        "--osl",
        str(output_len),
        "--extra-inputs",
        json.dumps({"ignore_eos": True, "temperature": 0}),
        "--tokenizer",
        str(TOKENIZER_DIR),
        "--random-seed",
        str(seed),
        "--request-timeout-seconds",
        "900",
        "--ui",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--export-level",
        "raw",
        "--artifact-dir",
        str(out_dir),
    ]
    run = _timed_run(argv, server)
    summary_path = out_dir / "profile_export_aiperf.json"
    if run.proc.returncode != 0 or not summary_path.exists():
        raise RuntimeError(
            f"aiperf failed ({run.proc.returncode}): {run.proc.stdout[-1500:]} "
            f"{run.proc.stderr[-1500:]}"
        )
    raw = [
        json.loads(line)
        for line in (out_dir / "profile_export_raw.jsonl").read_text().splitlines()
        if line.strip()
    ]
    records = [
        json.loads(line)
        for line in (out_dir / "profile_export.jsonl").read_text().splitlines()
        if line.strip()
    ]
    measured = [
        r["metadata"] for r in records if r["metadata"].get("benchmark_phase") == "profiling"
    ]
    start = min(m["request_start_ns"] for m in measured) / 1e9
    end = max(m["request_end_ns"] for m in measured) / 1e9
    window = run.cores(start, end) | {"measured_s": round(end - start, 3)}
    return json.loads(summary_path.read_text()), _join(records, raw), argv, window


@dataclasses.dataclass
class Sampled:
    """A client run to completion, with (wall time, client tree CPU s, server CPU s) samples."""

    proc: subprocess.CompletedProcess[str]
    samples: list[tuple[float, float, float]]
    exited: float

    def cores(self, start: float, end: float) -> dict[str, float | None]:
        """CPU cores the client (its process tree) and the server used in [start, end]."""
        if end - start <= 0 or len(self.samples) < 2:
            return {"client_cores": None, "server_cores": None}
        t = [x[0] for x in self.samples]

        def at(i: int, when: float) -> float:
            return float(np.interp(when, t, [x[i] for x in self.samples]))

        span = end - start
        return {
            "client_cores": round((at(1, end) - at(1, start)) / span, 3),
            "server_cores": round((at(2, end) - at(2, start)) / span, 3),
        }


def _tree_cpu(pid: int) -> float:
    total, frontier = 0.0, [pid]
    while frontier:
        current = frontier.pop()
        total += proc_cpu(current)
        for task in _listdir(f"/proc/{current}/task"):
            try:
                children = Path(f"/proc/{current}/task/{task}/children").read_text()
            except OSError:
                continue
            frontier.extend(int(c) for c in children.split())
    return total


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _timed_run(argv: list[str], server: Server) -> Sampled:
    """Run a client to completion, sampling its CPU and the server's every 0.2 s."""
    samples: list[tuple[float, float, float]] = []
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True)
        client_cpu = 0.0
        while proc.poll() is None:
            client_cpu = max(client_cpu, _tree_cpu(proc.pid))
            samples.append((time.time(), client_cpu, server.cpu_seconds()))
            time.sleep(0.2)
        exited = time.time()
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(argv, proc.returncode, out.read(), err.read())
    return Sampled(done, samples, exited)


def _join(records: list[dict[str, Any]], raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """aiperf's measured requests: its own per-request metrics, plus what its raw export
    shows (output text, end of stream) to compare definitions with."""
    by_id = {r["metadata"]["x_request_id"]: r for r in raw}
    out = []
    for rec in records:
        meta = rec["metadata"]
        if meta.get("benchmark_phase") != "profiling":
            continue
        metrics = {k: v.get("value") for k, v in (rec.get("metrics") or {}).items()}
        row = by_id.get(meta["x_request_id"])
        text, content_ns, end_ns = "", [], None
        if row is not None:
            for response in row.get("responses") or []:
                for packet in response.get("packets") or []:
                    if packet.get("name") != "data":
                        continue
                    end_ns = response["perf_ns"]
                    if packet.get("value") == "[DONE]":
                        continue
                    data = json.loads(packet["value"])
                    for choice in data.get("choices") or []:
                        if choice.get("text"):
                            text += choice["text"]
                            content_ns.append(response["perf_ns"])
        start = row["start_perf_ns"] if row is not None else None
        out.append(
            {
                "ok": not rec.get("error") and metrics.get("request_latency") is not None,
                "error": rec.get("error"),
                "ttft_ms": metrics.get("time_to_first_token"),
                "request_latency_ms": metrics.get("request_latency"),
                "inter_token_latency_ms": metrics.get("inter_token_latency"),
                "inter_chunk_latency_ms": metrics.get("inter_chunk_latency") or [],
                "output_sequence_length": metrics.get("output_sequence_length"),
                "usage_completion_tokens": metrics.get("usage_completion_tokens"),
                "input_sequence_length": metrics.get("input_sequence_length"),
                "usage_prompt_tokens": metrics.get("usage_prompt_tokens"),
                "content_chunks": len(content_ns),
                # request start to the stream's last event ([DONE]), as tributary bench times e2e
                "e2e_to_done_ms": (end_ns - start) / 1e6 if start and end_ns else None,
                "text": text,
            }
        )
    return out


def replay(out_dir: Path, concurrency: int, output_len: int) -> dict[str, Any]:
    """tributary bench's own stream parser and report, fed the SSE events aiperf recorded
    (its raw export: every event with the perf_counter time it was read) for its measured
    requests: the two clients' arithmetic on the very same events."""
    from tributary.bench import BenchConfig, Workload, WorkloadSpec
    from tributary.bench.backends import Backend
    from tributary.bench.report import summarize
    from tributary.bench.streams import OpenAIStream, RequestRecord, StreamFailure

    measured = {
        json.loads(line)["metadata"]["x_request_id"]
        for line in (out_dir / "profile_export.jsonl").read_text().splitlines()
        if line.strip() and '"profiling"' in line
    }
    records, ends = [], []
    for line in (out_dir / "profile_export_raw.jsonl").read_text().splitlines():
        raw = json.loads(line)
        if raw["metadata"]["x_request_id"] not in measured:
            continue
        rec = RequestRecord(index=len(records), prompt_tokens=0, start=raw["start_perf_ns"] / 1e9)
        parser = OpenAIStream(rec, chat=False)
        end = rec.start
        try:
            for response in raw.get("responses") or []:
                for packet in response.get("packets") or []:
                    if packet.get("name") == "data":
                        end = response["perf_ns"] / 1e9
                        parser.on_data(packet["value"].strip(), end)
            rec.e2e_latency = end - rec.start
            parser.finish()
            rec.ok = True
        except StreamFailure as exc:
            rec.error = str(exc)
        records.append(rec)
        ends.append(end)
    first = min(r.start for r in records)
    result = summarize(
        BenchConfig(num_prompts=len(records), concurrency=concurrency, output_len=output_len),
        Backend(kind="openai", base_url="", endpoint="/v1/completions", output_len=output_len),
        Workload(
            spec=WorkloadSpec(num_prompts=len(records)),
            prompts=[],
            warmup_prompts=[],
            tokenizer_url="",
        ),
        records,
        duration=max(ends) - first,
        started_at=datetime.datetime.now(datetime.UTC),
        warmup_records=[],
        run_start=first,
        client_cpu=0.0,
    )
    result.pop("requests", None)
    return result


# -- the comparison ------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _stat(summary: dict[str, Any], key: str, stat: str) -> float | None:
    entry = summary.get(key)
    return None if not isinstance(entry, dict) else entry.get(stat)


#: (row label, tributary bench's figure, aiperf's figure, note). Figures are read from each
#: client's own output; `a:` keys are aiperf's summary (key, statistic), `x:` keys are computed
#: here from aiperf's per-request records.
ROWS: list[tuple[str, str, str, str]] = [
    ("Request throughput (req/s)", "request_throughput", "a:request_throughput:avg", ""),
    (
        "Output tok/s",
        "output_throughput",
        "a:output_token_throughput:avg",
        "aiperf: its tokenizer's count of the output text",
    ),
    (
        "Output tok/s, server's token count",
        "output_throughput",
        "x:usage_output_throughput",
        "aiperf: usage.completion_tokens over its own duration",
    ),
    (
        "Output tok/s per server CPU core",
        "output_per_server_core",
        "x:output_per_server_core",
        "server's count over the CPU the server got",
    ),
    ("Duration (s)", "duration", "a:benchmark_duration:avg", ""),
    ("TTFT mean (ms)", "mean_ttft_ms", "a:time_to_first_token:avg", ""),
    ("TTFT p50 (ms)", "median_ttft_ms", "a:time_to_first_token:p50", ""),
    ("TTFT p99 (ms)", "p99_ttft_ms", "a:time_to_first_token:p99", ""),
    (
        "ITL mean (ms), chunk gaps",
        "mean_itl_ms",
        "a:inter_chunk_latency:avg",
        "aiperf: inter_chunk_latency",
    ),
    (
        "ITL p50 (ms), chunk gaps",
        "median_itl_ms",
        "a:inter_chunk_latency:p50",
        "aiperf: inter_chunk_latency",
    ),
    (
        "TPOT mean (ms) = aiperf ITL",
        "mean_tpot_ms",
        "a:inter_token_latency:avg",
        "(e2e - TTFT) / (tokens - 1) in both",
    ),
    (
        "TPOT p50 (ms) = aiperf ITL",
        "median_tpot_ms",
        "a:inter_token_latency:p50",
        "(e2e - TTFT) / (tokens - 1) in both",
    ),
    ("E2E mean (ms)", "mean_e2e_latency_ms", "a:request_latency:avg", "aiperf: to last text chunk"),
    (
        "E2E p50 (ms)",
        "median_e2e_latency_ms",
        "a:request_latency:p50",
        "aiperf: to last text chunk",
    ),
    (
        "E2E mean (ms), both to end of stream",
        "mean_e2e_latency_ms",
        "x:mean_e2e_to_done_ms",
        "aiperf: from its raw export, to [DONE]",
    ),
]

#: Rows left out for the sim runner: aiperf's tokenizer count of the output text means nothing
#: there (the sim's tokens are bytes, not SmolLM2's), and its server spends almost no CPU.
SIM_SKIPPED = {
    "Output tok/s",
    "TPOT mean (ms) = aiperf ITL",
    "TPOT p50 (ms) = aiperf ITL",
    "Output tok/s per server CPU core",
}

#: The rows of the headline table in the markdown.
HEADLINE = [
    "Request throughput (req/s)",
    "Output tok/s",
    "Output tok/s, server's token count",
    "Output tok/s per server CPU core",
    "TTFT mean (ms)",
    "TTFT p50 (ms)",
    "TTFT p99 (ms)",
    "ITL mean (ms), chunk gaps",
    "ITL p50 (ms), chunk gaps",
    "TPOT mean (ms) = aiperf ITL",
    "TPOT p50 (ms) = aiperf ITL",
    "E2E mean (ms)",
    "E2E p50 (ms)",
    "E2E mean (ms), both to end of stream",
]


def aiperf_extra(summary: dict[str, Any], requests: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in requests if r["ok"]]
    usage = sum(r["usage_completion_tokens"] or 0 for r in done)
    osl = sum(r["output_sequence_length"] or 0 for r in done)
    duration = _stat(summary, "benchmark_duration", "avg")
    to_done = [r["e2e_to_done_ms"] for r in done if r["e2e_to_done_ms"] is not None]
    return {
        "completed": len(done),
        "failed": len(requests) - len(done),
        "total_usage_completion_tokens": usage,
        "total_output_sequence_length": osl,
        "usage_output_throughput": usage / duration if duration else None,
        "mean_e2e_to_done_ms": _mean(to_done),
        "median_e2e_to_done_ms": _pct(to_done, 50),
        "requests_with_osl_not_usage": sum(
            r["output_sequence_length"] != r["usage_completion_tokens"] for r in done
        ),
        "mean_content_chunks": _mean([r["content_chunks"] for r in done]),
    }


def figure(key: str, tb: dict[str, Any], ai: dict[str, Any], extra: dict[str, Any]) -> Any:
    if key.startswith("a:"):
        _, name, stat = key.split(":")
        return _stat(ai, name, stat)
    if key.startswith("x:"):
        return extra.get(key[2:])
    return tb.get(key)


def compare(
    measurements: list[dict[str, Any]], levels: list[Level], *, replayed: bool = False
) -> dict[str, Any]:
    """Per concurrency and row: both clients' figure in each round, the per-round ratio
    tributary bench / aiperf, and the median of both figures and of the ratios. With
    `replayed`, tributary bench's figures are those of its code fed aiperf's own events."""
    for m in measurements:  # output tokens per CPU-second the server got while measured
        tb, extra = m["tributary_bench"], m["aiperf"]["extra"]
        tb_cores = m["tributary_bench_run"]["measured_window"]["server_cores"]
        ai_cores = m["aiperf_run"]["measured_window"]["server_cores"]
        tb["output_per_server_core"] = tb["output_throughput"] / tb_cores if tb_cores else None
        usage = extra["usage_output_throughput"]
        extra["output_per_server_core"] = usage / ai_cores if usage and ai_cores else None
    table: dict[str, Any] = {}
    for lv in levels:
        pairs = [m for m in measurements if m["concurrency"] == lv.concurrency]
        rows = []
        for label, tb_key, ai_key, note in ROWS:
            tb_values = [
                figure(tb_key, m["aiperf"]["replay"] if replayed else m["tributary_bench"], {}, {})
                for m in pairs
            ]
            ai_values = [
                figure(ai_key, {}, m["aiperf"]["summary"], m["aiperf"]["extra"]) for m in pairs
            ]
            ratios = [
                t / a for t, a in zip(tb_values, ai_values, strict=True) if t is not None and a
            ]
            rows.append(
                {
                    "metric": label,
                    "note": note,
                    "tributary_bench": tb_values,
                    "aiperf": ai_values,
                    "ratios": ratios,
                    "tributary_bench_median": _median(tb_values),
                    "aiperf_median": _median(ai_values),
                    "ratio_median": _median(ratios),
                    "ratio_min": min(ratios) if ratios else None,
                    "ratio_max": max(ratios) if ratios else None,
                }
            )
        table[str(lv.concurrency)] = rows
    return table


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


# -- tokenizer check -----------------------------------------------------------------------------


def tokenizer_check(url: str, texts: dict[str, list[str]], tmp: Path) -> dict[str, Any]:
    """Token ids of each text from Tributary's /tokenize (the model's llama.cpp vocabulary)
    and from the Hugging Face tokenizer aiperf counts with."""
    result: dict[str, Any] = {}
    with httpx.Client(timeout=60.0, trust_env=False) as client:
        for kind, items in texts.items():
            if not items:
                continue
            server = []
            for text in items:
                r = client.post(
                    url + "/tokenize", json={"prompt": text, "add_special_tokens": False}
                )
                r.raise_for_status()
                server.append(r.json()["tokens"])
            path = tmp / f"tok-{kind}.json"
            path.write_text(json.dumps(items))
            out = subprocess.run(
                [
                    str(AIPERF_VENV / "bin" / "python"),
                    "-c",
                    HF_TOKENIZE,
                    str(TOKENIZER_DIR),
                    str(path),
                ],
                capture_output=True,
                text=True,
                check=True,
                env=dict(os.environ, HF_HUB_OFFLINE="1"),
            )
            hf = json.loads(out.stdout)
            differ = [
                {"text": t[:200], "server": len(s), "hf": len(h)}
                for t, s, h in zip(items, server, hf, strict=True)
                if s != h
            ]
            result[kind] = {
                "texts": len(items),
                "same_ids": len(items) - len(differ),
                "same_count": sum(len(s) == len(h) for s, h in zip(server, hf, strict=True)),
                "server_tokens": sum(len(s) for s in server),
                "hf_tokens": sum(len(h) for h in hf),
                "differences": differ[:10],
            }
    return result


# -- the run -------------------------------------------------------------------------------------


def build_prompts(url: str, total: int, input_len: int, seed: int) -> list[dict[str, Any]]:
    import trio

    from tributary.bench import ServerTokenizer, WorkloadSpec, build_workload

    async def build() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as client:
            spec = WorkloadSpec(num_prompts=total, input_len=input_len, seed=seed, warmup=0)
            workload = await build_workload(ServerTokenizer(client, url), spec)
        return [{"text": p.text, "tokens": p.tokens} for p in workload.prompts]

    return trio.run(build)


def write_prompt_files(
    prompts: list[dict[str, Any]],
    lv: Level,
    input_len: int,
    output_len: int,
    seed: int,
    url: str,
    stem: Path,
) -> tuple[Path, Path]:
    """The same (warm-up, measured) prompts as tributary bench's --load-prompts file and as
    aiperf's single_turn JSONL, warm-up first."""
    warm, measured = prompts[: lv.warmup], prompts[lv.warmup :]
    tb_file = stem.with_suffix(".json")
    tb_file.write_text(
        json.dumps(
            {
                "spec": {
                    "num_prompts": len(measured),
                    "input_len": input_len,
                    "shared_prefix_len": 0,
                    "seed": seed,
                    "warmup": len(warm),
                },
                "tokenizer_url": url,
                "prompts": measured,
                "warmup_prompts": warm,
            },
            ensure_ascii=False,
        )
    )
    ai_file = stem.with_suffix(".jsonl")
    ai_file.write_text(
        "".join(
            json.dumps({"text": p["text"], "output_length": output_len}, ensure_ascii=False) + "\n"
            for p in prompts
        )
    )
    return tb_file, ai_file


def server_argv(runner: str, port: int, threads: int, context_length: int) -> list[str]:
    """bench/serving.py's `tributary` server (the thread count adjustable), or the same with the
    sim runner: a stand-in model whose steps sleep (engine/runners/sim.py), so its timing does
    not depend on the CPU the client leaves it."""
    argv = [
        str(VENV_BIN / "tributary"),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--max-running-requests",
        "16",
        "--context-length",
        str(context_length),
        "--log-level",
        "warning",
    ]
    return [*argv, "--runner", "sim"] if runner == "sim" else argv


def measure_server(
    runner: str, rounds: int, args: argparse.Namespace, work: Path, stamp: str
) -> dict[str, Any]:
    """Start one server, measure it with both clients, alternating, and stop it."""
    levels: list[Level] = args.levels
    port = free_port()
    argv = server_argv(runner, port, args.threads, args.context_length)
    server = Server(
        ServerSpec(f"tributary ({runner})", argv, "/health"),
        argv,
        PEERS / "logs" / f"crosscheck-{stamp}-{runner}.log",
    )
    load_s = server.start(port)
    print(f"{runner}: up in {load_s:.1f} s: {shlex.join(argv)}", file=sys.stderr, flush=True)
    measurements: list[dict[str, Any]] = []
    try:
        with httpx.Client(timeout=30.0, trust_env=False) as client:
            model = client.get(server.url + "/v1/models").json()["data"][0]["id"]
        per_round = sum(2 * (lv.warmup + lv.num_prompts) for lv in levels)
        prompts = build_prompts(server.url, rounds * per_round, args.input_len, args.seed)
        cursor = 0
        for round_no in range(rounds):
            for lv in levels:
                order = ["tributary_bench", "aiperf"]
                if round_no % 2:
                    order.reverse()
                entry: dict[str, Any] = {
                    "round": round_no + 1,
                    "concurrency": lv.concurrency,
                    "num_prompts": lv.num_prompts,
                    "warmup": lv.warmup,
                    "order": order,
                }
                for client_name in order:
                    chunk = prompts[cursor : cursor + lv.warmup + lv.num_prompts]
                    cursor += lv.warmup + lv.num_prompts
                    stem = work / f"{runner}-r{round_no + 1}-c{lv.concurrency}-{client_name}"
                    tb_file, ai_file = write_prompt_files(
                        chunk, lv, args.input_len, args.output_len, args.seed, server.url, stem
                    )
                    print(
                        f"  [{runner} round {round_no + 1}] c={lv.concurrency} {client_name}: "
                        f"load {loadavg()}",
                        file=sys.stderr,
                        flush=True,
                    )
                    probe = LoadProbe.begin(own_cpu() + server.cpu_seconds())
                    t0 = time.perf_counter()
                    if client_name == "tributary_bench":
                        out = stem.with_name(stem.name + "-out.json")
                        result, cmd, window = run_tributary_bench(
                            server, lv, tb_file, args.output_len, out
                        )
                        result.pop("requests", None)
                        entry["tributary_bench"] = result
                    else:
                        summary, reqs, cmd, window = run_aiperf(
                            server, model, lv, ai_file, args.output_len, stem, args.seed
                        )
                        entry["aiperf"] = {
                            "summary": _small_summary(summary),
                            "extra": aiperf_extra(summary, reqs),
                            "replay": replay(stem, lv.concurrency, args.output_len),
                            "output_texts": [r["text"] for r in reqs],
                        }
                    load = probe.end(own_cpu() + server.cpu_seconds())
                    entry[f"{client_name}_run"] = {
                        "argv": cmd,
                        "wall_s": round(time.perf_counter() - t0, 2),
                        "measured_window": window,
                        "load": load,
                    }
                    print(
                        f"    {time.perf_counter() - t0:.0f} s; measured window: client "
                        f"{window['client_cores']} cores, server {window['server_cores']}; "
                        f"others {load['other_cores']:.2f}",
                        file=sys.stderr,
                        flush=True,
                    )
                measurements.append(entry)
        output_texts = [t for m in measurements for t in m["aiperf"].pop("output_texts")]
        tokenizers = (
            tokenizer_check(
                server.url,
                {
                    "prompts": [p["text"] for p in prompts[:cursor]],
                    "aiperf_output_texts": output_texts,
                },
                work,
            )
            if runner == "llama"
            else None
        )
    finally:
        server.stop()
    return {
        "runner": runner,
        "server_argv": argv,
        "rounds": rounds,
        "comparison": compare(measurements, levels),
        "replay_comparison": compare(measurements, levels, replayed=True),
        "tokenizer_check": tokenizers,
        "measurements": measurements,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="measurements per client and level")
    p.add_argument(
        "--levels",
        nargs="+",
        type=parse_level,
        default=[parse_level("4:40"), parse_level("1:12")],
        metavar="C:N",
        help="concurrency C with N measured requests (warm-up: max(C, 2) more)",
    )
    p.add_argument(
        "--sim-rounds",
        type=int,
        default=1,
        help="rounds against the sim runner too (0: none), the control for client CPU",
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="Tributary's llama.cpp threads")
    p.add_argument("--context-length", type=int, default=8192)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output", type=Path, default=DOCS / "crosscheck.json")
    p.add_argument("--markdown", type=Path, default=DOCS / "crosscheck.md")
    p.add_argument("--no-docs", action="store_true", help="write only --output")
    p.add_argument(
        "--render", action="store_true", help="only write the markdown again from --output"
    )
    args = p.parse_args()

    if args.render:
        doc = json.loads(args.output.read_text())
        s = doc["settings"]
        for run in doc["runs"]:
            lvls = [Level(**lv) for lv in doc["settings"]["levels"]]
            for m in run["measurements"]:
                argv = m["aiperf_run"]["argv"]
                artifacts = Path(argv[argv.index("--artifact-dir") + 1])
                if artifacts.exists():
                    m["aiperf"]["replay"] = replay(artifacts, m["concurrency"], s["output_len"])
                m["aiperf"].pop("requests", None)  # files from before the summaries kept them
            run["comparison"] = compare(run["measurements"], lvls)
            run["replay_comparison"] = compare(run["measurements"], lvls, replayed=True)
        args.output.write_text(summary_json(doc))
        args.markdown.write_text(render_markdown(doc, existing_notes(args.markdown)))
        print(render_table(doc))
        return
    if not (AIPERF_VENV / "bin" / "aiperf").exists() or not TOKENIZER_DIR.exists():
        sys.exit("no aiperf: run `python3 bench/peers.py setup-aiperf` first")
    started_at = datetime.datetime.now(datetime.UTC)
    t_start = time.perf_counter()
    stamp = started_at.strftime("%Y%m%dT%H%M%S")
    work = WORK / stamp
    work.mkdir(parents=True, exist_ok=True)
    (PEERS / "logs").mkdir(parents=True, exist_ok=True)

    runs = [measure_server("llama", args.rounds, args, work, stamp)]
    if args.sim_rounds:
        runs.append(measure_server("sim", args.sim_rounds, args, work, stamp))
    doc = {
        "generated_by": "bench/crosscheck.py",
        "date": started_at.isoformat(timespec="seconds"),
        "runtime_s": round(time.perf_counter() - t_start, 1),
        "machine": machine_info(),
        "code": code_state(),
        "aiperf_version": _aiperf_version(),
        "settings": {
            "rounds": args.rounds,
            "sim_rounds": args.sim_rounds,
            "levels": [dataclasses.asdict(lv) for lv in args.levels],
            "input_len": args.input_len,
            "output_len": args.output_len,
            "threads": args.threads,
            "context_length": args.context_length,
            "seed": args.seed,
        },
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(summary_json(doc))
    print(render_table(doc))
    if not args.no_docs:
        args.markdown.write_text(render_markdown(doc, existing_notes(args.markdown)))
        print(f"wrote {args.output} and {args.markdown}", file=sys.stderr)


def _small_summary(summary: dict[str, Any]) -> dict[str, Any]:
    keep = {
        "request_throughput",
        "request_count",
        "error_request_count",
        "benchmark_duration",
        "output_token_throughput",
        "time_to_first_token",
        "inter_token_latency",
        "inter_chunk_latency",
        "request_latency",
        "output_sequence_length",
        "input_sequence_length",
        "usage_completion_tokens",
        "usage_prompt_tokens",
        "total_output_tokens",
    }
    stats = ("avg", "p50", "p90", "p99", "min", "max", "std", "count", "unit")
    return {
        k: {s: v[s] for s in stats if s in v} if isinstance(v, dict) else v
        for k, v in summary.items()
        if k in keep
    }


def _aiperf_version() -> str | None:
    out = subprocess.run(
        [
            str(AIPERF_VENV / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('aiperf'))",
        ],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or None


# -- report --------------------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def render_table(doc: dict[str, Any]) -> str:
    lines = []
    for run in doc["runs"]:
        for concurrency, rows in run["comparison"].items():
            lines.append(
                f"{run['runner']} runner, concurrency {concurrency} (medians over "
                f"{run['rounds']} rounds; ratio = tributary bench / aiperf)"
            )
            lines.append(f"{'metric':<40}{'tributary bench':>16}{'aiperf':>12}{'ratio':>8}  range")
            for row in rows:
                lines.append(
                    f"{row['metric']:<40}{_fmt(row['tributary_bench_median']):>16}"
                    f"{_fmt(row['aiperf_median']):>12}{_fmt(row['ratio_median'], '.3f'):>8}  "
                    f"[{_fmt(row['ratio_min'], '.3f')}, {_fmt(row['ratio_max'], '.3f')}]"
                )
            lines.append("")
    return "\n".join(lines)


def render_markdown(doc: dict[str, Any], notes: str) -> str:
    m, s = doc["machine"], doc["settings"]
    levels = ", ".join(
        f"concurrency {lv['concurrency']} ({lv['num_prompts']} requests after "
        f"{lv['warmup']} warm-up)"
        for lv in s["levels"]
    )
    lines = [
        "# Cross-check: `tributary bench` against aiperf",
        "",
        "Generated by `bench/crosscheck.py` (`just bench-crosscheck`); its figures are in",
        "[crosscheck.json](crosscheck.json). Hand-written notes are kept between the markers "
        "below.",
        "",
        f"Run on {doc['date']}: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Python "
        f"{m['python']}; Tributary at commit `{doc['code']['commit'][:10]}`; aiperf "
        f"{doc['aiperf_version']}. {doc['runtime_s'] / 60:.1f} minutes in all.",
        "",
        NOTES_START + notes + NOTES_END,
        "",
        "## Workload",
        "",
        f"- Streaming `/v1/completions`, prompts of {s['input_len']} tokens built with the "
        f"server's tokenizer (seed {s['seed']}), {s['output_len']} greedy output tokens with "
        f"`ignore_eos`; {levels}. Every measurement gets prompts of its own; the two clients "
        "of a pair run back to back, their order alternating each round.",
    ]
    for run in doc["runs"]:
        lines.append(
            f"- {run['runner']} runner, {run['rounds']} round(s): "
            f"`{shlex.join(_short(run['server_argv']))}`"
        )
    lines.append("")
    for run in doc["runs"]:
        for concurrency, rows in run["comparison"].items():
            lines += [
                f"## {run['runner'].capitalize()} runner, concurrency {concurrency}",
                "",
                f"Medians over {run['rounds']} round(s); the ratio is tributary bench / aiperf "
                "per round: its median and range.",
                "",
                "| metric | tributary bench | aiperf | ratio | range | note |",
                "|---|---:|---:|---:|---:|---|",
            ]
            if run["runner"] == "sim":
                lines[-4:-4] = [
                    "Rows that rest on aiperf's tokenizer count of the output text (output "
                    "tok/s by that count, TPOT) are left out: the sim runner's tokens are bytes; "
                    "so is the rate per server core (the sim's server barely uses the CPU).",
                    "",
                ]
            for row in rows:
                if row["metric"] not in HEADLINE:
                    continue
                if run["runner"] == "sim" and row["metric"] in SIM_SKIPPED:
                    continue
                lines.append(
                    f"| {row['metric']} | {_fmt(row['tributary_bench_median'])} | "
                    f"{_fmt(row['aiperf_median'])} | {_fmt(row['ratio_median'], '.3f')} | "
                    f"{_fmt(row['ratio_min'], '.3f')}-{_fmt(row['ratio_max'], '.3f')} | "
                    f"{row['note']} |"
                )
            lines.append("")
    lines += [
        "## The same events through both clients' arithmetic",
        "",
        "tributary bench's own stream parser and report (`OpenAIStream`, `summarize`) fed the "
        "SSE events aiperf recorded (its raw export, each event with the time aiperf read it), "
        "against aiperf's figures for the same requests: what is left is only how each "
        "client defines a figure. Ratio tributary bench's code / aiperf, median over the "
        "measurements.",
        "",
    ]
    for run in doc["runs"]:
        replayed = run.get("replay_comparison") or {}
        if not replayed:
            continue
        levels_seen = list(replayed)
        lines.append(
            f"| {run['runner']} runner | " + " | ".join(f"c={c}" for c in levels_seen) + " |"
        )
        lines.append("|---|" + "---:|" * len(levels_seen))
        for i, row in enumerate(replayed[levels_seen[0]]):
            if row["metric"] not in HEADLINE or row["ratio_median"] is None:
                continue
            if run["runner"] == "sim" and row["metric"] in SIM_SKIPPED:
                continue
            cells = [_fmt(replayed[c][i]["ratio_median"], ".4f") for c in levels_seen]
            lines.append(f"| {row['metric']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Per measurement",
        "",
        "CPU during each client's measured window (warm-up and start-up excluded), in cores: "
        "the client's process tree, the server's, and everything else on the machine.",
        "",
        "| runner | round | c | client | out tok/s (server count) | client | server | others |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for run in doc["runs"]:
        for meas in run["measurements"]:
            for client in meas["order"]:
                info = meas[f"{client}_run"]
                window, load = info["measured_window"], info["load"]
                tok_s = (
                    meas["tributary_bench"]["output_throughput"]
                    if client == "tributary_bench"
                    else meas["aiperf"]["extra"]["usage_output_throughput"]
                )
                lines.append(
                    f"| {run['runner']} | {meas['round']} | {meas['concurrency']} | "
                    f"{client.replace('_', ' ')} | {_fmt(tok_s)} | "
                    f"{_fmt(window['client_cores'])} | {_fmt(window['server_cores'])} | "
                    f"{load['other_cores']:.2f} |"
                )
    lines.append("")
    lines += [
        "## Token counts",
        "",
        "The tokenizer aiperf counts with (built from the GGUF by `bench/peers.py setup-aiperf`)",
        "against the model's own, Tributary's `/tokenize`:",
        "",
    ]
    for run in doc["runs"]:
        for kind, check in (run["tokenizer_check"] or {}).items():
            lines.append(
                f"- {kind.replace('_', ' ')}: {check['same_ids']} of {check['texts']} texts get "
                f"the same token ids ({check['server_tokens']} tokens by `/tokenize`, "
                f"{check['hf_tokens']} by the Hugging Face tokenizer)."
            )
    first = doc["runs"][0]["measurements"][0]
    lines += [
        "",
        "## Commands",
        "",
        "```bash",
        "just bench-crosscheck  # python3 bench/peers.py setup-aiperf; "
        ".venv/bin/python bench/crosscheck.py",
        "# one measurement of each client, as run (paths shortened):",
        shlex.join(_short(first["tributary_bench_run"]["argv"])),
        shlex.join(_short(first["aiperf_run"]["argv"])),
        "```",
        "",
    ]
    return "\n".join(lines)


def _short(argv: list[str]) -> list[str]:
    out = []
    for a in argv:
        if a.startswith(str(REPO)):
            a = os.path.relpath(a, REPO)
        out.append(a)
    return out


if __name__ == "__main__":
    main()
