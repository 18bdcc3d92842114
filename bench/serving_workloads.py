"""The workloads of `bench/serving.py --workloads`, and what their summary and targets are.

- `fresh`: prompts of --input-len tokens no server has seen (a new set per round,
  measurement and try), --output-len greedy tokens (`ignore_eos`), at each --concurrency.
- `repeated`: one fixed prompt set, the same for every round and measurement (a benchmark's
  fixed prompt set, a retried request): each measurement at concurrency c sends the set's
  first n prompts, and before round 1 every server is sent the whole set once (the warm-up
  pass), so both servers' caches hold it from the first measured request on.
- `repetitive`: one client, `/v1/chat/completions` (the chat template makes the instruct model
  copy), each prompt one of the code snippets of bench/repetitive/ (about 300 tokens) with
  an instruction to reproduce it with one identifier renamed; up to --repetitive-max-tokens
  greedy tokens, stopping at EOS (the copy ends there; greedy output is the same on both
  servers, and the page shows the tokens per request of each). Every prompt of a run is a
  different (snippet, identifier, new name) and the instruction comes first, so no prefix
  cache serves one prompt from another beyond the chat template's first tokens.

Server variants: `tributary` (the defaults), `llama-server`, and `tributary-NAME` for each
flag set of VARIANT_FLAGS or `--tributary-flags NAME='FLAGS'`. WORKLOAD_SERVERS says which
servers each workload measures (`--workload-servers WORKLOAD=a,b,c` changes it).

Every ratio is taken within a round, between two servers measured back to back on the same
prompts, and the targets (TARGETS, issue 32) take the median over rounds.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

WORKLOADS = ("fresh", "repeated", "repetitive")
TASKS = Path(__file__).resolve().parent / "repetitive" / "tasks.json"

#: The flags of each Tributary variant `tributary-NAME` (`--tributary-flags` overrides them).
VARIANT_FLAGS = {
    "spec": "--speculative-algorithm NGRAM",
    "prefix-any": "--prefix-reuse any",
}

#: The servers each workload measures, in the order of the first round.
WORKLOAD_SERVERS = {
    "fresh": ("tributary", "tributary-spec", "llama-server"),
    "repeated": ("tributary", "tributary-prefix-any", "llama-server"),
    "repetitive": ("tributary", "tributary-spec", "llama-server"),
}


def parse_assignments(items: Iterable[str], what: str) -> dict[str, str]:
    """`NAME=VALUE` items as {NAME: VALUE}; a malformed one is an error naming `what`."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{what}: expected NAME=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def variant_flags(overrides: dict[str, str]) -> dict[str, list[str]]:
    """Each variant's name (without `tributary-`) and its flags: VARIANT_FLAGS with
    `overrides` on top (a new name adds a variant)."""
    return {name: shlex.split(flags) for name, flags in (VARIANT_FLAGS | overrides).items()}


def unknown_flags(flags: list[str], help_text: str) -> list[str]:
    """The options of `flags` that `tributary serve --help` does not list."""
    return [
        f.split("=")[0] for f in flags if f.startswith("--") and f.split("=")[0] not in help_text
    ]


def workload_servers(
    workloads: list[str], overrides: dict[str, str], only: list[str] | None
) -> dict[str, list[str]]:
    """The servers each of `workloads` measures: WORKLOAD_SERVERS, `overrides`
    (WORKLOAD -> `a,b,c`) on top, kept to `only` when given."""
    unknown = set(overrides) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"--workload-servers: unknown workloads {sorted(unknown)}")
    out = {}
    for workload in workloads:
        names = (
            [n.strip() for n in overrides[workload].split(",") if n.strip()]
            if workload in overrides
            else list(WORKLOAD_SERVERS[workload])
        )
        out[workload] = [n for n in names if only is None or n in only]
    return out


# -- the repetitive workload's prompts ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Snippet:
    name: str
    code: str
    rename: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Tasks:
    instruction: str
    snippets: tuple[Snippet, ...]
    new_names: tuple[str, ...]


def load_tasks(path: Path = TASKS) -> Tasks:
    doc = json.loads(path.read_text())
    snippets = tuple(
        Snippet(s["file"], (path.parent / s["file"]).read_text(), tuple(s["rename"]))
        for s in doc["snippets"]
    )
    return Tasks(doc["instruction"], snippets, tuple(doc["new_names"]))


def repetitive_prompt(tasks: Tasks, snippet: Snippet, old: str, new: str) -> str:
    instruction = tasks.instruction.format(old=old, new=new)
    return f"{instruction}\n\n```python\n{snippet.code.rstrip()}\n```"


def repetitive_prompts(tasks: Tasks) -> list[str]:
    """Every prompt the tasks make, in an order that cycles through the snippets first, then
    the identifiers, then the new names (so any few consecutive prompts copy different
    code). A new name already in the snippet is skipped."""
    combos = []
    for new in tasks.new_names:
        for k in range(max(len(s.rename) for s in tasks.snippets)):
            for snippet in tasks.snippets:
                if k < len(snippet.rename) and new not in snippet.code:
                    combos.append(repetitive_prompt(tasks, snippet, snippet.rename[k], new))
    return combos


# -- summary and targets --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """`label`'s output tok/s over `reference`'s on `workload` at each of `concurrency`
    (those measured), the median of the per-round ratios at least `threshold`."""

    workload: str
    label: str
    reference: str
    concurrency: tuple[int, ...]
    threshold: float

    def describe(self, c: int) -> str:
        return (
            f"{self.workload} c={c}: {self.label} / {self.reference} output tok/s "
            f">= {self.threshold:g}"
        )


#: Issue 32's targets. The variants' rows (prefix-any on repeated prompts) are measured
#: against the same bar as the defaults, to show which setting meets it.
TARGETS = (
    Target("fresh", "tributary", "llama-server", (1, 4, 16), 1.05),
    Target("repeated", "tributary", "llama-server", (1, 4, 16), 1.0),
    Target("repeated", "tributary-prefix-any", "llama-server", (1, 4, 16), 1.0),
    Target("repetitive", "tributary-spec", "llama-server", (1,), 1.5),
    Target("fresh", "tributary-spec", "tributary", (1, 4, 16), 0.97),
)


def used_runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The measurements the tables use (the last try of each), each with its workload."""
    return [run for rec in records for run in rec["runs"] if run.get("used", True)]


def by_round(
    runs: list[dict[str, Any]], workload: str, label: str, c: int
) -> dict[int, dict[str, Any]]:
    return {
        r["round"]: r
        for r in runs
        if r["workload"] == workload and r["label"] == label and r["max_concurrency"] == c
    }


def round_ratios(
    runs: list[dict[str, Any]], workload: str, label: str, reference: str, c: int
) -> list[tuple[int, float]]:
    """(round, `label`'s output tok/s / `reference`'s) of each round that measured both."""
    mine, ref = by_round(runs, workload, label, c), by_round(runs, workload, reference, c)
    return [
        (n, mine[n]["output_throughput"] / ref[n]["output_throughput"])
        for n in sorted(mine.keys() & ref.keys())
        if mine[n]["output_throughput"] and ref[n]["output_throughput"]
    ]


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def output_tokens(run: dict[str, Any]) -> float | None:
    """Output tokens per completed request of one measurement, on average."""
    done = [q["output_tokens"] for q in run["requests"] if q.get("ok")]
    return statistics.fmean(done) if done else None


def summarize_workloads(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per workload, server and concurrency: output tok/s and TTFT p50 per round and
    their medians, the ratio to llama-server per round and its median."""
    keys = sorted(
        {(r["workload"], r["label"], r["max_concurrency"]) for r in runs},
        key=lambda k: (WORKLOADS.index(k[0]) if k[0] in WORKLOADS else 99, k[2], k[1]),
    )
    rows = []
    for workload, label, c in keys:
        mine = by_round(runs, workload, label, c)
        ratios = round_ratios(runs, workload, label, "llama-server", c)
        rounds = sorted(mine)
        rows.append(
            {
                "workload": workload,
                "label": label,
                "concurrency": c,
                "rounds": rounds,
                "output_throughput": median(mine[n]["output_throughput"] for n in rounds),
                "output_throughput_per_round": [mine[n]["output_throughput"] for n in rounds],
                "vs_llama_server": median(v for _, v in ratios)
                if label != "llama-server"
                else None,
                "vs_llama_server_per_round": [round(v, 4) for _, v in ratios]
                if label != "llama-server"
                else [],
                "median_ttft_ms": median(mine[n]["median_ttft_ms"] for n in rounds),
                "median_ttft_ms_per_round": [mine[n]["median_ttft_ms"] for n in rounds],
                "p99_ttft_ms": median(mine[n]["p99_ttft_ms"] for n in rounds),
                "median_itl_ms": median(mine[n]["median_itl_ms"] for n in rounds),
                "output_tokens_per_request": median(output_tokens(mine[n]) for n in rounds),
                "failed": sum(mine[n]["failed"] for n in rounds),
                "busy_rounds": [n for n in rounds if mine[n].get("contaminated")],
            }
        )
    return rows


def evaluate_targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of TARGETS at each concurrency where both servers were measured: the per-round
    ratios, their median, and whether it meets the bar."""
    out = []
    for t in TARGETS:
        for c in t.concurrency:
            ratios = round_ratios(runs, t.workload, t.label, t.reference, c)
            if not ratios:
                continue
            value = statistics.median(v for _, v in ratios)
            out.append(
                {
                    "target": t.describe(c),
                    "workload": t.workload,
                    "label": t.label,
                    "reference": t.reference,
                    "concurrency": c,
                    "threshold": t.threshold,
                    "per_round": [round(v, 4) for _, v in ratios],
                    "value": value,
                    "met": value >= t.threshold,
                }
            )
    return out


# -- how long a run takes -------------------------------------------------------------------

#: Output tok/s of one server on this 2-core machine at a concurrency, as `tributary bench`
#: counts it (first tokens included: at 1, a 60-token prefill of 0.2 s and 64 tokens at 10 ms
#: on the Xeon; 140 and 205 at 4 and 16 on the EPYC, a little less here), prompt tokens per
#: second of a long prefill, and the fixed costs: a `tributary bench` process (start,
#: import, warm-up connection) per measurement, the 3-second quiet check per measurement slot.
OUTPUT_TOK_S = {1: 80.0, 4: 125.0, 16: 180.0}
PREFILL_TOK_S = 300.0
CLIENT_S = 2.5
QUIET_CHECK_S = 3.0
SERVER_START_S = 8.0
#: Tokens of a repetitive prompt with the chat template (a snippet of about 300 and the
#: instruction).
REPETITIVE_PROMPT_TOKENS = 340


def output_rate(c: int) -> float:
    """OUTPUT_TOK_S at the nearest concurrency listed."""
    return OUTPUT_TOK_S[min(OUTPUT_TOK_S, key=lambda k: abs(k - c))]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One measurement of a round, as the estimate sees it: its servers and its size."""

    servers: int
    concurrency: int
    requests: int
    prompt_tokens: int
    output_tokens: int


def slot_seconds(slot: Slot) -> float:
    per_server = (
        slot.requests * slot.output_tokens / output_rate(slot.concurrency)
        + slot.requests * max(slot.prompt_tokens - 60, 0) / PREFILL_TOK_S
        + CLIENT_S
    )
    return QUIET_CHECK_S + slot.servers * per_server


def estimate_seconds(slots: list[Slot], rounds: int, servers: int, primes: list[Slot]) -> float:
    """The expected length of a run: every slot each round, the servers' start-ups, and the
    repeated workload's warm-up pass (`primes`, once)."""
    measured = rounds * sum(slot_seconds(s) for s in slots)
    return measured + servers * SERVER_START_S + sum(slot_seconds(p) for p in primes) + 20.0
