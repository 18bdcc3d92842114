"""The page of a `bench/serving.py --workloads` run (docs/benchmarks/serving-workloads.md),
and what both serving pages say of the machine, the builds and the load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from page_notes import NOTES_END, NOTES_START
from serving_machine import isa_line

#: What each workload's section says it measured ({...} filled from the run's config).
ABOUT = {
    "fresh": "Streaming `/v1/completions`, prompts of {input_len} tokens that no server had "
    "seen (a new set per round, measurement and try), {output_len} greedy tokens each "
    "(`ignore_eos`).",
    "repeated": "Streaming `/v1/completions`, one fixed set of {repeated_count} prompts of "
    "{input_len} tokens: every measurement at concurrency c sends the set's first n, every "
    "round; before round 1 each server got the whole set once (the warm-up pass), so every "
    "measured prompt had been seen. {output_len} greedy tokens each (`ignore_eos`). "
    "llama-server keeps each slot's last prompt and older ones in its prompt cache in RAM "
    "(`--cache-ram`, 8,192 MiB by default).",
    "repetitive": "One client, streaming `/v1/chat/completions`: a code snippet of about 300 "
    "tokens (bench/repetitive/) and an instruction to reproduce it with one identifier "
    "renamed, a different (snippet, identifier, new name) for every request of the run; up to "
    "{max_tokens} greedy tokens, stopping at EOS (`tokens/req.` shows each server's).",
}


def fmt(v: Any, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def listed(values: list[Any], spec: str = ".2f") -> str:
    return ", ".join(fmt(v, spec) for v in values)


def machine_lines(doc: dict[str, Any]) -> list[str]:
    """The CPU's instruction sets, how each side's llama.cpp was built, and whether each
    server repacks (from what the run recorded; nothing for runs from before it did)."""
    m, builds = doc["machine"], doc.get("builds", {})
    lines = []
    if "isa" in m:
        lines.append(f"- CPU: {m['cpu']}, {m['cores']} cores; {isa_line(m['isa'])}.")
    ls = builds.get("llama-server")
    if ls:
        flags = " ".join(f for f in ls["cmake_flags"] if "AMX" in f or "NATIVE" in f)
        probe = ls.get("probe", {})
        lines.append(
            f"- llama-server: llama.cpp `{ls['llama_cpp_commit'][:10]}` (vendored by "
            f"llama-cpp-python {ls['version']}), built by bench/peers.py with `{flags}`; "
            f"kernels: {probe.get('system_info', 'n/a')}."
        )
    trib = builds.get("tributary", {}).get("llama_cpp_python")
    if trib:
        lines.append(
            f"- Tributary: llama-cpp-python {trib.get('version', 'n/a')} in .venv; kernels: "
            f"{trib.get('system_info', trib.get('error', 'n/a'))}"
            + (" (**AMX compiled in**)." if trib.get("amx") else ".")
        )
    for label, said in doc.get("repack", {}).items():
        lines.append(f"- Repacked weights, {label}: {said}.")
    return lines


def load_lines(doc: dict[str, Any]) -> list[str]:
    """The table of the CPU others used during each round and server."""
    lines = [
        "| round | server | others (cores) | steal (cores) | load average before "
        "| measurements redone |",
        "|---:|---|---:|---:|---|---:|",
    ]
    for row in doc["rounds"]:
        before = ", ".join(f"{x:.2f}" for x in row["loadavg_before"])
        lines.append(
            f"| {row['round']} | {row['label']} | {row['other_cores']:.2f} | "
            f"{row['steal_cores']:.2f} | {before} | {row['redone']} |"
        )
    return lines


def target_lines(doc: dict[str, Any]) -> list[str]:
    lines = ["| target | per round | median | met |", "|---|---|---:|---|"]
    for t in doc["targets"]:
        rounds = len(t["per_round"])
        met = "yes" if t["met"] else "**no**"
        if rounds < 3:
            met += f" ({rounds} round{'s' if rounds > 1 else ''}: not enough to decide)"
        lines.append(f"| {t['target']} | {listed(t['per_round'])} | {t['value']:.3f} | {met} |")
    return lines


def workload_lines(doc: dict[str, Any], workload: str) -> list[str]:
    config = doc["config"]
    about = ABOUT[workload].format(
        input_len=config["input_len"],
        output_len=config["output_len"],
        repeated_count=doc["prompts"].get("repeated", {}).get("count", "n/a"),
        max_tokens=config["repetitive"]["max_tokens"],
    )
    lines = [
        f"## {workload.capitalize()}",
        "",
        about,
        "",
        "| server | conc. | output tok/s (per round) | vs llama-server (per round) | target "
        "| TTFT p50 ms (per round) | TTFT p99 ms | tokens/req. | failed |",
        "|---|---:|---|---|---|---|---:|---:|---:|",
    ]
    bars = {
        (t["workload"], t["label"], t["concurrency"]): t
        for t in doc["targets"]
        if t["reference"] == "llama-server"
    }
    for r in doc["rows"]:
        if r["workload"] != workload:
            continue
        name = r["label"] + (" †" if r["busy_rounds"] else "")
        ratio = (
            f"**{r['vs_llama_server']:.3f}** ({listed(r['vs_llama_server_per_round'], '.3f')})"
            if r["vs_llama_server"] is not None
            else "-"
        )
        bar = bars.get((workload, r["label"], r["concurrency"]))
        target = f">= {bar['threshold']:g}: {'met' if bar['met'] else '**missed**'}" if bar else ""
        lines.append(
            f"| {name} | {r['concurrency']} | {fmt(r['output_throughput'])} "
            f"({listed(r['output_throughput_per_round'], '.1f')}) | {ratio} | {target} | "
            f"{fmt(r['median_ttft_ms'], '.0f')} ({listed(r['median_ttft_ms_per_round'], '.0f')})"
            f" | {fmt(r['p99_ttft_ms'], '.0f')} | {fmt(r['output_tokens_per_request'], '.0f')} | "
            f"{r['failed']} |"
        )
    if workload == "repeated" and doc["prompts"].get("warmup_pass"):
        lines += [
            "",
            "The warm-up pass (each server's first sight of the set, at concurrency "
            f"{max(config['concurrency'])}): "
            + "; ".join(
                f"{label} {fmt(v['output_throughput'])} tok/s, TTFT p50 "
                f"{fmt(v['median_ttft_ms'], '.0f')} ms"
                for label, v in doc["prompts"]["warmup_pass"].items()
            )
            + ".",
        ]
    return [*lines, ""]


def server_lines(doc: dict[str, Any]) -> list[str]:
    lines = [
        "Idle CPU: what a server used while the others were measured (at most, in one "
        "measurement); an idle server's work slows the one measured.",
        "",
        "| server | workloads | start-up (s) | peak RSS (MiB) | idle CPU (cores) "
        "| idle CPU s, most in one |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for s in doc["servers"]:
        lines.append(
            f"| {s['label']} | {', '.join(s['workloads'])} | {fmt(s['startup_s'])} | "
            f"{fmt(s['peak_rss_mib'], '.0f')} | {fmt(s.get('idle_cores'), '.3f')} | "
            f"{fmt(s.get('idle_cpu_s_max'), '.2f')} |"
        )
    for label, why in doc["config"].get("skipped", {}).items():
        lines.append(f"\n{label} was left out: {why}.")
    for s in doc["servers"]:
        if s["log_mentions"]:
            lines += ["", f"{s['label']}'s log on repacking and AMX:", "", "```"]
            lines += [*s["log_mentions"], "```"]
    return lines


def render_workloads(doc: dict[str, Any], notes: str) -> str:
    config, m = doc["config"], doc["machine"]
    dirty = doc["code"]["dirty"]
    json_name = config.get("page_json", "serving-workloads.json")
    lines = [
        "# Serving workloads: Tributary next to llama-server",
        "",
        "Generated by `bench/serving.py --workloads` (`just bench-serving --workloads ...`); its",
        f"figures are in [{json_name}]({json_name}). Hand-written notes are kept between the",
        "markers below. The default run (fresh prompts, with `/generate`, unary requests and",
        "llama_cpp.server) is [serving.md](serving.md).",
        "",
        f"Run on {doc['date']}: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
        f"Python {m['python']}; Tributary at commit `{doc['code']['commit'][:10]}`"
        + (f" with local changes in {len(dirty)} file(s)" if dirty else "")
        + f". {config['rounds']} rounds, interleaved: each measurement ran on its servers back "
        "to back, on the same prompts, in an order rotated from one measurement and round to "
        f"the next. It took {doc['duration_s'] / 60:.0f} min (expected "
        f"{config['expected_s'] / 60:.0f}).",
        "",
        NOTES_START,
        notes.strip() or "_(no notes yet)_",
        NOTES_END,
        "",
        "## Targets (issue 32)",
        "",
        "Output tok/s of one server over another's, taken within each round (the two measured",
        "back to back on the same prompts); the median over the rounds decides.",
        "",
        *target_lines(doc),
        "",
        "## Machine and builds",
        "",
        *machine_lines(doc),
        f"- Model: `{Path(config['model']).name}`, 2 threads on every server, "
        f"{config['context_length']} tokens of context per slot, 16 slots.",
        "",
    ]
    for workload in config["workloads"]:
        lines += workload_lines(doc, workload)
    busy = [r for r in doc["rows"] if r["busy_rounds"]]
    if busy:
        lines += [
            "† Measured while other processes used more than "
            f"{config['contamination']} cores in all {config['attempts']} tries (rounds "
            + "; ".join(
                f"{r['workload']} {r['label']} c={r['concurrency']}: "
                + listed(r["busy_rounds"], "d")
                for r in busy
            )
            + ").",
            "",
        ]
    lines += [
        "## Servers",
        "",
        *server_lines(doc),
        "",
        "## Load on the machine",
        "",
        "CPU used by processes outside the benchmark during each server's measurements of the",
        f"round, in cores (the machine has {m['cores']}). A measurement during which others",
        f"used more than {config['contamination']} cores was done again on fresh prompts (up to",
        f"{config['attempts']} tries, every server of it); the tables use the last try.",
        "",
        *load_lines(doc),
        "",
        "## Commands",
        "",
        "```bash",
        config["recipe"],
        "```",
        "",
        "The servers, as started (port and paths of this run):",
        "",
        "```bash",
        *doc["server_commands"],
        "```",
        "",
        "The client, for example:",
        "",
        "```bash",
        *doc["client_commands"],
        "```",
        "",
    ]
    return "\n".join(lines)
