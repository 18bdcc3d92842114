"""bench/serving.py's workloads (`--workloads fresh repeated repetitive`): how the servers and
variants are chosen, the prompts each workload sends, the ratios and targets the page shows,
the expected duration, and what the run records of the machine and of each side's llama.cpp.
The measuring itself (servers, `tributary bench`) is what a run does; these are the parts a
wrong figure on the page would come from."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import serving  # noqa: E402
import serving_machine as machine  # noqa: E402
import serving_page as page  # noqa: E402
import serving_workloads as wl  # noqa: E402

# -- servers and variants -------------------------------------------------------------------


def test_variant_flags_default_and_overridden() -> None:
    flags = wl.variant_flags(
        wl.parse_assignments(
            ["spec=--speculative-algorithm NGRAM --speculative-num-draft-tokens 8", "big=--x 1"],
            "--tributary-flags",
        )
    )
    assert flags["spec"] == [
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-draft-tokens",
        "8",
    ]
    assert flags["prefix-any"] == ["--prefix-reuse", "any"]
    assert flags["big"] == ["--x", "1"]


def test_an_assignment_without_a_name_is_refused_with_its_option() -> None:
    with pytest.raises(ValueError, match="--tributary-flags: expected NAME=VALUE, got 'spec'"):
        wl.parse_assignments(["spec"], "--tributary-flags")


def test_unknown_flags_are_those_serve_does_not_list() -> None:
    help_text = "usage: tributary serve [--prefix-reuse {exact,any}] [--threads THREADS]"
    assert wl.unknown_flags(["--prefix-reuse", "any", "--threads=2"], help_text) == []
    assert wl.unknown_flags(["--speculative-algorithm", "NGRAM"], help_text) == [
        "--speculative-algorithm"
    ]


def test_workload_servers_defaults_overrides_and_filter() -> None:
    chosen = wl.workload_servers(["fresh", "repetitive"], {}, None)
    assert chosen == {
        "fresh": ["tributary", "tributary-spec", "llama-server"],
        "repetitive": ["tributary", "tributary-spec", "llama-server"],
    }
    chosen = wl.workload_servers(
        ["fresh", "repeated"],
        {"repeated": "tributary, llama-server"},
        ["tributary", "llama-server"],
    )
    assert chosen == {
        "fresh": ["tributary", "llama-server"],
        "repeated": ["tributary", "llama-server"],
    }
    with pytest.raises(ValueError, match="unknown workloads \\['stale'\\]"):
        wl.workload_servers(["fresh"], {"stale": "tributary"}, None)


def test_a_server_is_measured_only_on_its_workloads() -> None:
    spec = serving.ServerSpec("tributary-spec", ["x"], "/health", workloads=frozenset({"fresh"}))
    lv = serving.Level(1, 8, 1)
    assert serving.Measurement("openai", lv, "fresh").offered_by(spec)
    assert not serving.Measurement("openai", lv, "repeated").offered_by(spec)
    # The default run's servers (no workloads named) take every measurement they have a
    # backend for.
    plain = serving.ServerSpec("tributary", ["x"], "/health")
    assert serving.Measurement("openai", lv, "repetitive").offered_by(plain)
    assert not serving.Measurement("generate", lv).offered_by(
        serving.ServerSpec("llama-server", ["x"], "/health")
    )


def test_the_plan_runs_each_workload_on_the_servers_named_for_it() -> None:
    specs = [
        serving.ServerSpec("tributary", ["x"], "/health", workloads=frozenset(wl.WORKLOADS)),
        serving.ServerSpec("llama-server", ["x"], "/health", workloads=frozenset({"fresh"})),
    ]
    lvls = serving.levels([1, 16], per_client=3, min_prompts=8)
    args = argparse.Namespace(repetitive_requests=5)
    plan = serving.workload_plan(["repetitive", "fresh"], lvls, specs, args)
    assert [(m.workload, m.level.concurrency if m.level else None) for m in plan] == [
        ("repetitive", 1),
        ("fresh", 1),
        ("fresh", 16),
    ]
    assert plan[0].level == serving.Level(1, 5, 1)
    assert plan[2].level == serving.Level(16, 48, 16)
    assert [s.label for s in specs if plan[0].offered_by(s)] == ["tributary"]


# -- prompts --------------------------------------------------------------------------------


def test_repeated_prompts_are_one_file_every_round_fresh_ones_a_new_file() -> None:
    lv = serving.Level(4, 12, 4)
    repeated, fresh = (
        serving.Measurement("openai", lv, "repeated"),
        serving.Measurement("openai", lv),
    )
    assert {repeated.prompt_key(r, a) for r in (1, 2, 3) for a in (0, 1)} == {"repeated-openai-c4"}
    keys = {fresh.prompt_key(r, a) for r in (1, 2, 3) for a in (0, 1)}
    assert len(keys) == 6
    # The default run's keys are what they were (older raw files stay readable).
    assert fresh.prompt_key(2, 1) == "r2-openai-c4-a1"


def test_the_repetitive_workload_asks_chat_and_stops_at_eos() -> None:
    args = argparse.Namespace(output_len=64, repetitive_max_tokens=400)
    lv = serving.Level(1, 4, 1)
    assert serving.Measurement("openai", lv, "repetitive").client_options(args) == (
        400,
        ["--endpoint", "/v1/chat/completions", "--no-ignore-eos"],
    )
    assert serving.Measurement("openai", lv, "repeated").client_options(args) == (64, [])


def test_snippets_are_python_and_name_what_they_rename() -> None:
    tasks = wl.load_tasks()
    assert len(tasks.snippets) >= 4
    for snippet in tasks.snippets:
        ast.parse(snippet.code)  # real code, as a user would paste it
        assert 900 < len(snippet.code) < 1400, snippet.name  # about 300 tokens
        for old in snippet.rename:
            assert re.search(rf"\b{old}\b", snippet.code), (snippet.name, old)


def test_repetitive_prompts_are_all_different_and_start_with_the_instruction() -> None:
    tasks = wl.load_tasks()
    prompts = wl.repetitive_prompts(tasks)
    assert len(prompts) == len(set(prompts)) >= 100
    # Consecutive prompts copy different snippets.
    first = [next(s.name for s in tasks.snippets if s.code.rstrip() in p) for p in prompts[:4]]
    assert len(set(first)) == 4
    # No two prompts share more than the instruction's first words: a prefix cache cannot
    # serve one from another.
    head = tasks.instruction.split("`")[0]
    for prompt in prompts:
        assert prompt.startswith(head)
        old, new = re.findall(r"`(\w+)`", prompt)[:2]
        snippet = next(s for s in tasks.snippets if s.code.rstrip() in prompt)
        assert old in snippet.rename and new not in snippet.code
        assert prompt.endswith(f"```python\n{snippet.code.rstrip()}\n```")


# -- summary and targets --------------------------------------------------------------------


def run(workload: str, label: str, c: int, rnd: int, tok_s: float, **extra: Any) -> dict[str, Any]:
    return {
        "workload": workload,
        "label": label,
        "max_concurrency": c,
        "round": rnd,
        "output_throughput": tok_s,
        "median_ttft_ms": extra.get("ttft", 100.0),
        "p99_ttft_ms": 200.0,
        "median_itl_ms": 10.0,
        "failed": extra.get("failed", 0),
        "contaminated": extra.get("contaminated", False),
        "used": extra.get("used", True),
        "requests": [{"ok": True, "output_tokens": extra.get("tokens", 64)}],
    }


def records(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"label": r["label"], "runs": [r]} for r in runs]


def test_ratios_pair_servers_within_each_round() -> None:
    runs = wl.used_runs(
        records(
            [
                run("fresh", "tributary", 1, 1, 110.0, ttft=90.0),
                run("fresh", "llama-server", 1, 1, 100.0),
                run("fresh", "tributary", 1, 2, 90.0, ttft=80.0),
                run("fresh", "llama-server", 1, 2, 100.0),
                run("fresh", "tributary", 1, 3, 120.0, ttft=70.0, contaminated=True),
                run("fresh", "llama-server", 1, 3, 100.0),
                # a try that was measured again: not used
                run("fresh", "tributary", 1, 3, 10.0, used=False),
            ]
        )
    )
    rows = {(r["label"], r["concurrency"]): r for r in wl.summarize_workloads(runs)}
    trib = rows[("tributary", 1)]
    assert trib["vs_llama_server_per_round"] == [1.1, 0.9, 1.2]
    assert trib["vs_llama_server"] == pytest.approx(1.1)
    assert trib["output_throughput"] == 110.0
    assert trib["median_ttft_ms"] == 80.0
    assert trib["median_ttft_ms_per_round"] == [90.0, 80.0, 70.0]
    assert trib["busy_rounds"] == [3]
    assert rows[("llama-server", 1)]["vs_llama_server"] is None


def test_targets_take_the_median_of_round_ratios_and_name_the_bar() -> None:
    runs = []
    for rnd, (trib, spec, ls) in enumerate([(105, 104, 100), (110, 100, 100), (95, 95, 100)], 1):
        runs += [
            run("fresh", "tributary", 4, rnd, trib),
            run("fresh", "tributary-spec", 4, rnd, spec),
            run("fresh", "llama-server", 4, rnd, ls),
            run("repetitive", "tributary-spec", 1, rnd, 160.0 + rnd, tokens=280),
            run("repetitive", "llama-server", 1, rnd, 100.0, tokens=280),
        ]
    found = {t["target"]: t for t in wl.evaluate_targets(runs)}
    fresh = found["fresh c=4: tributary / llama-server output tok/s >= 1.05"]
    assert fresh["per_round"] == [1.05, 1.1, 0.95]
    assert fresh["value"] == pytest.approx(1.05) and fresh["met"]
    spec = found["fresh c=4: tributary-spec / tributary output tok/s >= 0.97"]
    assert spec["per_round"] == pytest.approx([104 / 105, 100 / 110, 1.0], abs=1e-4)
    assert spec["value"] == pytest.approx(104 / 105) and spec["met"]
    rep = found["repetitive c=1: tributary-spec / llama-server output tok/s >= 1.5"]
    assert rep["value"] == pytest.approx(1.62) and rep["met"]
    # Nothing measured at 1 or 16 on fresh, nor the repeated workload: no target claimed.
    assert all(t["concurrency"] == 4 or t["workload"] == "repetitive" for t in found.values())
    assert not [t for t in found.values() if t["workload"] == "repeated"]


def test_a_missed_target_is_marked_and_few_rounds_are_said() -> None:
    runs = [
        run("repeated", "tributary", 16, 1, 70.0),
        run("repeated", "llama-server", 16, 1, 100.0),
    ]
    [target] = wl.evaluate_targets(runs)
    assert not target["met"]
    [line] = page.target_lines({"targets": [target]})[2:]
    assert "0.700 | **no** (1 round: not enough to decide)" in line


def test_the_summary_of_a_raw_run_says_per_server_how_it_repacks() -> None:
    def record(label: str, tok_s: float, **facts: Any) -> dict[str, Any]:
        return {
            "label": label,
            "round": 1,
            "command": f"{label} --port 1",
            "before": {"loadavg": [0.1, 0.2, 0.3]},
            "load": {"other_cores": 0.01, "steal_cores": 0.0, "wall_s": 10.0},
            "runs": [run("repetitive", label, 1, 1, tok_s, tokens=280)],
            "client_commands": [f"tributary bench --endpoint /v1/chat/completions --label {label}"],
            "startup_s": 5.0,
            "memory": {"peak_rss_mib": 300.0},
        } | facts

    raw = {
        "config": {"concurrency": [1], "workloads": ["repetitive"]},
        "prompts": {"texts": ["secret"], "repetitive": {"count": 5}},
        "builds": {"llama-server": {"probe": {"repacked_mib": 0.0}}},
        "records": [
            record("tributary-spec", 150.0, server_info_repack={"repack_weights": "off"}),
            record("llama-server", 100.0, no_repack_flag=False),
        ],
    }
    doc = serving.summarize_raw(raw)
    assert "records" not in doc and "texts" not in doc["prompts"]
    assert doc["repack"] == {
        "tributary-spec": '/get_server_info: `repack_weights` = "off"',
        "llama-server": "on (llama-server's default); nothing repacked: no tensor of this "
        "model fits CPU_REPACK",
    }
    [target] = doc["targets"]
    assert target["value"] == 1.5 and target["met"]
    assert [s["label"] for s in doc["servers"]] == ["tributary-spec", "llama-server"]
    assert doc["client_commands"][-1].endswith("--label tributary-spec")


# -- duration -------------------------------------------------------------------------------


def test_estimate_adds_rounds_servers_and_the_warm_up_pass() -> None:
    slot = wl.Slot(servers=2, concurrency=1, requests=10, prompt_tokens=60, output_tokens=100)
    one = wl.slot_seconds(slot)
    # 2 servers x (1,000 tokens at the rate at 1 + a client start) + the quiet check
    assert one == pytest.approx(wl.QUIET_CHECK_S + 2 * (1000 / wl.OUTPUT_TOK_S[1] + wl.CLIENT_S))
    base = wl.estimate_seconds([slot], rounds=3, servers=2, primes=[])
    assert base == pytest.approx(3 * one + 2 * wl.SERVER_START_S + 20.0)
    assert wl.estimate_seconds([slot], 3, 2, [slot]) == pytest.approx(base + one)
    long = wl.Slot(servers=1, concurrency=1, requests=1, prompt_tokens=360, output_tokens=0)
    assert wl.slot_seconds(long) == pytest.approx(
        wl.QUIET_CHECK_S + 300 / wl.PREFILL_TOK_S + wl.CLIENT_S
    )


# -- machine and builds ---------------------------------------------------------------------

CPUINFO = """processor	: 0
model name	: Intel(R) Xeon(R) Processor
flags		: fpu avx avx2 avx512f avx512bw avx512vl avx512_vnni amx_tile amx_int8

processor	: 1
model name	: Intel(R) Xeon(R) Processor
flags		: fpu avx avx2 avx512f avx512bw avx512vl avx512_vnni amx_tile amx_int8
"""


def test_cpu_facts_name_the_cpu_and_each_flag_that_matters() -> None:
    facts = machine.cpu_facts(CPUINFO)
    assert facts["cpu"] == "Intel(R) Xeon(R) Processor"
    assert facts["isa"]["avx512_vnni"] and facts["isa"]["amx_int8"]
    assert not facts["isa"]["avx_vnni"] and not facts["isa"]["amx_bf16"]
    assert machine.isa_line(facts["isa"]).endswith("(not: avx512_bf16 avx_vnni amx_bf16)")


def test_system_info_says_which_kernels_were_compiled_in() -> None:
    line = (
        "system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | AVX2 = 1 | "
        "AVX512 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 0 | REPACK = 1 | "
    )
    features = machine.parse_system_info(line)
    assert features["AMX_INT8"] == "1" and features["OPENMP"] == "0"
    assert "n_threads" not in " ".join(features)
    assert machine.compiled_kernels(features) == "SSE3 AVX2 AVX512 AMX_INT8 LLAMAFILE REPACK"


def test_repacking_read_from_llama_cpp_load_log() -> None:
    refused = [
        "D done_getting_tensors: tensor 'token_embd.weight' (q8_0) (and 272 others) cannot be "
        "used with preferred buffer type CPU_REPACK, using CPU instead",
        "I load_tensors:   CPU_Mapped model buffer size =    92.10 MiB",
    ]
    assert machine.repack_from_log(refused)["repacked_mib"] == 0.0
    repacked = ["I load_tensors:   CPU_REPACK model buffer size =    60.50 MiB", *refused[1:]]
    assert machine.repack_from_log(repacked)["repacked_mib"] == 60.5
    assert machine.repack_from_log(refused[1:])["repacked_mib"] is None
    said = machine.repack_summary({"no_repack_flag": False, "probe": {"repacked_mib": 0.0}})
    assert (
        said
        == "on (llama-server's default); nothing repacked: no tensor of this model fits CPU_REPACK"
    )


def test_repack_fields_found_at_any_depth_once() -> None:
    info = {
        "repack_weights": "auto",
        "weights_repack": {"repacked": True, "amx": False},
        "placement": {"layers": [{"repacked_bytes": 3}]},
        "threads": 2,
    }
    assert machine.repack_fields(info) == {
        "repack_weights": "auto",
        "weights_repack": {"repacked": True, "amx": False},
        "placement.layers.0.repacked_bytes": 3,
    }
    line = machine.repack_summary({"server_info_repack": {"repack_weights": "auto"}})
    assert line == '/get_server_info: `repack_weights` = "auto"'
    # The server's own account (engine/repack.py's `weights_repack`) wins.
    said = {
        "setting": "auto",
        "enabled": True,
        "repacked_mib": 0.0,
        "reason": "llama.cpp without AMX",
    }
    line = machine.repack_summary({"server_info_repack": {"weights_repack": said}})
    assert line == "on (`--repack-weights auto`: llama.cpp without AMX); nothing repacked"
    said |= {"enabled": False, "repacked_mib": 58.5}
    line = machine.repack_summary({"server_info_repack": {"weights_repack": said}})
    assert line.startswith("off (") and line.endswith("; 58.5 MiB of weights repacked")


# -- the page -------------------------------------------------------------------------------


def test_the_page_keeps_its_notes_and_shows_every_workload_and_target() -> None:
    runs = []
    for rnd in (1, 2, 3):
        for workload, c in (("fresh", 1), ("repeated", 1), ("repetitive", 1)):
            runs += [
                run(workload, "tributary", c, rnd, 100.0 + rnd),
                run(workload, "llama-server", c, rnd, 100.0),
            ]
    doc = {
        "date": "2026-12-05T04:00:00+00:00",
        "duration_s": 1500,
        "machine": {
            "cpu": "Intel(R) Xeon(R) Processor",
            "cores": 2,
            "memory_gib": 23.5,
            "python": "3.11.7",
            "isa": machine.cpu_facts(CPUINFO)["isa"],
        },
        "builds": {},
        "code": {"commit": "0123456789abcdef", "dirty": []},
        "config": {
            "workloads": ["fresh", "repeated", "repetitive"],
            "rounds": 3,
            "expected_s": 1380,
            "input_len": 60,
            "output_len": 64,
            "concurrency": [1],
            "context_length": 8192,
            "model": "/m/SmolLM2-135M-Instruct.Q4_1.gguf",
            "repetitive": {"max_tokens": 400, "requests": 4},
            "contamination": 0.15,
            "attempts": 3,
            "recipe": ".venv/bin/python bench/serving.py --workloads fresh",
            "skipped": {"tributary-spec": "`tributary serve` has no --speculative-algorithm yet"},
        },
        "prompts": {"repeated": {"count": 8}, "warmup_pass": {}},
        "rows": wl.summarize_workloads(runs),
        "targets": wl.evaluate_targets(runs),
        "servers": [],
        "repack": {"llama-server": "on (llama-server's default)"},
        "rounds": [],
        "server_commands": [],
        "client_commands": [],
    }
    text = page.render_workloads(doc, "Hand-written: keep me.")
    assert "<!-- notes -->\nHand-written: keep me.\n" in text
    for heading in ("## Fresh", "## Repeated", "## Repetitive", "## Targets (issue 32)"):
        assert heading in text
    assert "| fresh c=1: tributary / llama-server output tok/s >= 1.05 | 1.01, 1.02, 1.03 " in text
    assert "| 1.020 | **no** |" in text
    assert "tributary-spec was left out: `tributary serve` has no --speculative-algorithm" in text
    assert "- Repacked weights, llama-server: on (llama-server's default)." in text
    assert "It took 25 min (expected 23)." in text
    # Each row's bar beside its ratio: fresh 1.05 missed, repeated 1.0 met.
    assert "| **1.020** (1.010, 1.020, 1.030) | >= 1.05: **missed** |" in text
    assert "| **1.020** (1.010, 1.020, 1.030) | >= 1: met |" in text
