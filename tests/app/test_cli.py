"""`tributary serve` as a user runs it: a subprocess on the sim runner, a startup line naming
the URL, model and context length, and a graceful exit on SIGINT/SIGTERM that lets an
in-flight request finish."""

from __future__ import annotations

import gc
import json
import re
import signal
import subprocess
import sys
from collections.abc import Awaitable
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from tributary.app.cli import build_parser, configs, main
from tributary.app.heap import GEN0_THRESHOLD, settle_heap

STARTUP = re.compile(r"Tributary serving (\S+) .*context length (\d+).* at (http://\S+)")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_serve_then_graceful_signal_shutdown(signum: signal.Signals) -> None:
    command = [
        sys.executable, "-m", "tributary", "serve", "--runner", "sim", "--port", "0",
        "--context-length", "512", "--log-level", "warning",
    ]  # fmt: skip
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert proc.stdout is not None
        line = b""
        with trio.fail_after(30):
            while b"\n" not in line:
                line += await proc.stdout.receive_some()
        match = STARTUP.search(line.decode())
        assert match, line
        model, context, url = match.groups()
        assert model == "sim" and context == "512"
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            ok = await client.post(
                "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}
            )
            assert ok.json()["meta_info"]["completion_tokens"] == 3
            results: list[httpx.Response] = []

            async def in_flight() -> None:
                body = {"text": "hi", "sampling_params": {"max_new_tokens": 60}}
                results.append(await client.post("/generate", json=body))

            nursery.start_soon(in_flight)
            await trio.sleep(0.2)  # the request is generating (60 tokens take ~0.8 s)
            proc.send_signal(signum)
            with trio.fail_after(15):
                await proc.wait()
    assert proc.returncode == 0
    assert results[0].status_code == 200
    assert results[0].json()["meta_info"]["completion_tokens"] == 60


async def test_second_signal_stops_at_once() -> None:
    command = [
        sys.executable, "-m", "tributary", "serve", "--runner", "sim", "--port", "0",
        "--graceful-timeout", "60", "--log-level", "warning",
    ]  # fmt: skip
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        url = await startup_url(proc)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            errors: list[Exception] = []

            async def in_flight() -> None:
                body = {"text": "hi", "sampling_params": {"max_new_tokens": 3000}}  # ~40 s
                try:
                    await client.post("/generate", json=body)
                except httpx.HTTPError as exc:
                    errors.append(exc)

            nursery.start_soon(in_flight)
            await trio.sleep(0.2)
            proc.send_signal(signal.SIGINT)  # graceful: would wait up to 60 s for the request
            await trio.sleep(0.2)
            assert proc.returncode is None
            start = trio.current_time()
            proc.send_signal(signal.SIGINT)
            with trio.fail_after(10):
                await proc.wait()
            assert trio.current_time() - start < 5
    assert proc.returncode == 0
    assert errors  # the in-flight request was cut, not completed


async def startup_url(proc: trio.Process) -> str:
    assert proc.stdout is not None
    line = b""
    with trio.fail_after(30):
        while b"\n" not in line:
            line += await proc.stdout.receive_some()
    match = STARTUP.search(line.decode())
    assert match, line
    return match.group(3)


def test_flags_map_to_engine_and_server_settings() -> None:
    args = build_parser().parse_args(
        [
            "serve", "--model-path", "/m.gguf", "--host", "0.0.0.0", "--port", "8000",
            "--context-length", "2048", "--max-running-requests", "4",
            "--max-queued-requests", "9", "--incremental-streaming-output",
            "--stream-interval", "3", "--runner", "sim", "--threads", "2",
            "--log-level", "debug", "--mmap",
        ]
    )  # fmt: skip
    engine_config, settings = configs(args)
    assert engine_config.mmap_weights
    assert engine_config.model_path == "/m.gguf" and engine_config.runner == "sim"
    assert engine_config.context_length == 2048 and engine_config.max_running_requests == 4
    assert engine_config.max_queued_requests == 9 and engine_config.stream_interval == 3
    assert engine_config.threads == 2
    assert settings.host == "0.0.0.0" and settings.port == 8000
    assert settings.incremental_streaming_output and settings.log_level == "debug"


def test_defaults_match_sglang() -> None:
    engine_config, settings = configs(build_parser().parse_args(["serve"]))
    assert settings.port == 30000 and settings.host == "127.0.0.1"
    assert engine_config.runner == "llama" and engine_config.model_path is None
    assert not engine_config.mmap_weights  # weights read into huge pages
    assert not settings.incremental_streaming_output


def sim_server(*flags: str) -> partial[Awaitable[trio.Process]]:
    """For `nursery.start`: `tributary serve` on the sim runner and a free port, with `flags`;
    stdout and stderr piped."""
    command = [sys.executable, "-m", "tributary", "serve", "--runner", "sim", "--port", "0"]
    return partial(
        trio.run_process,
        [*command, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        check=False,
    )


async def stop_and_read_stderr(proc: trio.Process) -> str:
    """SIGINT, then everything the server wrote to stderr until it exited."""
    proc.send_signal(signal.SIGINT)
    assert proc.stderr is not None
    err = b""
    with trio.fail_after(15):
        async for chunk in proc.stderr:
            err += chunk
        await proc.wait()
    return err.decode()


def test_operations_doc_lists_every_flag_with_its_default() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    rows = dict(re.findall(r"^\| `(--[a-z-]+)[^`]*`[^|]*\| ([^|]+) \|", doc, re.M))
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    for action in serve._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag in (None, "--help"):
            continue
        assert flag in rows, f"{flag} is not documented in docs/operations.md"
        if isinstance(action.default, int | float) and not isinstance(action.default, bool):
            assert float(rows[flag].strip("` ")) == action.default, flag


def test_observability_flags() -> None:
    _, defaults = configs(build_parser().parse_args(["serve"]))
    assert defaults.enable_metrics and not defaults.enable_request_timing
    assert defaults.log_format == "text" and not defaults.log_requests
    args = build_parser().parse_args(
        [
            "serve", "--disable-metrics", "--enable-request-timing", "--log-format", "json",
            "--log-requests",
        ]
    )  # fmt: skip
    _, settings = configs(args)
    assert not settings.enable_metrics and settings.enable_request_timing
    assert settings.log_format == "json" and settings.log_requests


async def test_json_access_log_on_stderr_without_the_prompt() -> None:
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            sim_server("--log-format", "json", "--enable-request-timing")
        )
        url = await startup_url(proc)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            body = {"text": "my secret", "rid": "cli-1", "sampling_params": {"max_new_tokens": 2}}
            meta = (await client.post("/generate", json=body)).json()["meta_info"]
            assert meta["queue_time"] <= meta["time_to_first_token"] <= meta["e2e_latency"]
            assert (await client.get("/metrics")).status_code == 200
        err = await stop_and_read_stderr(proc)
    records = [json.loads(line) for line in err.splitlines()]  # every line is JSON
    [access] = [r for r in records if r["logger"] == "tributary.access"]
    assert access["rid"] == "cli-1" and access["status"] == 200 and access["completion_tokens"] == 2
    assert access["e2e_latency"] == meta["e2e_latency"]
    assert "my secret" not in err


def test_kv_flags_map_to_engine_config() -> None:
    args = build_parser().parse_args(
        ["serve", "--kv-cache-dtype", "q8_0", "--prefix-cache-mb", "0",
         "--disable-parallel-sample-fork"]
    )  # fmt: skip
    engine_config, _ = configs(args)
    assert engine_config.kv_cache_dtype == "q8_0" and engine_config.prefix_cache_mb == 0
    assert not engine_config.fork_parallel_samples
    defaults, _ = configs(build_parser().parse_args(["serve"]))
    assert defaults.kv_cache_dtype == "auto" and defaults.prefix_cache_mb == 1024
    assert defaults.fork_parallel_samples


def test_prefill_flags_map_to_engine_config() -> None:
    args = build_parser().parse_args(
        ["serve", "--chunked-prefill-size", "128", "--max-prefill-tokens", "512"]
    )
    engine_config, _ = configs(args)
    assert engine_config.prefill_chunk_tokens == 128
    assert engine_config.prefill_budget == 512
    defaults, _ = configs(build_parser().parse_args(["serve"]))
    assert defaults.prefill_chunk_tokens == 256 and defaults.prefill_budget == 256
    too_small = build_parser().parse_args(["serve", "--max-prefill-tokens", "100"])
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        configs(too_small)


def test_settle_heap_freezes_the_start_up_heap_and_raises_the_young_threshold() -> None:
    before, frozen_before = gc.get_threshold(), gc.get_freeze_count()
    try:
        frozen = settle_heap(5000)
        assert frozen == gc.get_freeze_count() > frozen_before + 1000  # modules, functions, ...
        assert gc.get_threshold() == (5000, *before[1:])
        assert gc.isenabled()  # cycles are still collected
        with pytest.raises(ValueError, match="at least 1"):
            settle_heap(0)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


async def test_serve_settles_the_heap_once_serving_unless_told_not_to() -> None:
    async def log_of(*flags: str) -> str:
        async with trio.open_nursery() as nursery:
            proc: trio.Process = await nursery.start(sim_server("--log-level", "info", *flags))
            await startup_url(proc)
            return await stop_and_read_stderr(proc)

    settled = re.search(r"froze (\d+) start-up objects; gc threshold (\d+)", await log_of())
    assert settled, "no heap settling logged"
    assert int(settled[1]) > 1000 and int(settled[2]) == GEN0_THRESHOLD
    assert "froze" not in await log_of("--gc-threshold", "0")


def test_a_negative_gc_threshold_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--runner", "sim", "--gc-threshold", "-1"]) == 2
    assert "--gc-threshold must be at least 0, got -1" in capsys.readouterr().err


def test_placement_flags_take_llama_servers_names_and_values() -> None:
    args = build_parser().parse_args(
        ["serve", "-ngl", "all", "-mg", "1", "-sm", "row", "-ts", "3,1", "-nkvo"]
    )
    engine_config, _ = configs(args)
    assert engine_config.n_gpu_layers == "all" and engine_config.main_gpu == 1
    assert engine_config.split_mode == "row" and engine_config.tensor_split == (3.0, 1.0)
    assert not engine_config.kv_offload
    long_names = ["serve", "--n-gpu-layers", "12", "--base-gpu-id", "2", "--split-mode", "none"]
    engine_config, _ = configs(build_parser().parse_args(long_names))
    assert engine_config.n_gpu_layers == 12 and engine_config.main_gpu == 2
    assert engine_config.split_mode == "none"
    defaults, _ = configs(build_parser().parse_args(["serve"]))
    assert defaults.n_gpu_layers == "auto" and defaults.main_gpu == 0
    assert defaults.split_mode == "layer" and defaults.tensor_split == ()
    assert defaults.kv_offload


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-ngl", "most"], "--n-gpu-layers takes a number from 0, auto or all, got 'most'"),
        (["--tensor-split", "1,x"], "--tensor-split takes proportions from 0"),
    ],
)
def test_bad_placement_values_are_refused_at_start_up(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


async def test_a_cpu_only_build_ignores_gpu_flags_and_says_where_the_layers_went() -> None:
    """On this CPU-only llama.cpp, asking for every layer on a GPU is ignored with a warning,
    as llama-server does, and start-up and /get_server_info say all 30 are on the CPU."""
    command = [
        sys.executable, "-m", "tributary", "serve", "--port", "0", "-ngl", "99",
        "--context-length", "256", "--max-running-requests", "2", "--prefix-cache-mb", "0",
    ]  # fmt: skip
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            partial(
                trio.run_process, command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                check=False,
            )
        )  # fmt: skip
        url = await startup_url(proc)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            info = (await client.get("/get_server_info")).json()
        err = await stop_and_read_stderr(proc)
    placement = info["placement"]
    assert placement["summary"] == "0/30 layers on CPU (no GPU backend)"
    assert placement["n_gpu_layers"] == 0 and not placement["gpu_backend"]
    assert placement["devices"] == [] and placement["host_kv_bytes"] > 0
    assert info["n_gpu_layers"] == 99  # the flag as given, echoed with the other settings
    assert "--n-gpu-layers 99 ignored: llama.cpp has no GPU backend" in err
    assert "0/30 layers on CPU (no GPU backend)" in err
