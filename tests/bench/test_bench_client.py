"""`tributary bench` as a user runs it: against a real Tributary (sim runner, Hypercorn on port
0) over both backends, at fixed concurrency and Poisson arrivals; every failure counted with its
reason; the JSON keys docs/benchmarks/client.md documents; the PNG plots; and the wire shapes
of servers other than Tributary (llama.cpp's, vLLM's) through httpx's mock transport."""

from __future__ import annotations

import itertools
import json
import re
import socket
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

sys.path.insert(0, str(Path(__file__).parents[1] / "app"))

from apphelpers import running_server, server_settings, sim_config

from tributary.app import cli as app_cli
from tributary.bench import (
    Backend,
    BenchConfig,
    Prompt,
    RequestRecord,
    ServerTokenizer,
    WorkloadSpec,
    build_workload,
    load_workload,
    plot_latency_cdfs,
    plot_throughput_vs_concurrency,
    render_table,
    run_benchmark,
    save_workload,
)
from tributary.bench.backends import send_request
from tributary.bench.streams import GenerateStream

DOC = Path(__file__).parents[2] / "docs" / "benchmarks" / "client.md"
PNG = b"\x89PNG\r\n\x1a\n"


def small(url: str, **overrides: Any) -> BenchConfig:
    settings: dict[str, Any] = {
        "base_url": url,
        "num_prompts": 12,
        "input_len": 24,
        "output_len": 8,
        "warmup": 2,
    }
    settings.update(overrides)
    return BenchConfig(**settings)


def assert_all_completed(
    result: dict[str, Any], config: BenchConfig, *, exact_itl: bool = True
) -> None:
    n, out = config.num_prompts, config.output_len
    assert (result["completed"], result["failed"], result["failure_reasons"]) == (n, 0, {})
    assert result["total_output_tokens"] == n * out  # ignore_eos: every request runs to length
    assert result["total_input_tokens"] == n * config.input_len  # the sim counts bytes exactly
    assert all(r["ok"] and r["output_tokens"] == out for r in result["requests"])
    for r in result["requests"]:
        # A cumulative /generate stream may coalesce a backlog into one frame, which then
        # adds one gap per token it brings; only the first frame's tokens have none.
        assert len(r["itl"]) == out - 1 if exact_itl else 1 <= len(r["itl"]) <= out - 1
        assert r["ttft"] + sum(r["itl"]) <= r["e2e_latency"]
    assert result["warmup"] == config.warmup and result["warmup_failed"] == 0
    for metric in ("ttft", "tpot", "itl", "e2e_latency"):
        assert 0 < result[f"median_{metric}_ms"] <= result[f"p99_{metric}_ms"]
    assert result["median_ttft_ms"] < result["median_e2e_latency_ms"]
    assert result["output_throughput"] == pytest.approx(n * out / result["duration"])


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_generate_backend_at_fixed_concurrency(incremental: bool) -> None:
    settings = server_settings(incremental_streaming_output=incremental)
    async with running_server(settings=settings) as server:
        config = small(server.url, concurrency=4)
        result = await run_benchmark(config)
    assert_all_completed(result, config, exact_itl=incremental)
    assert result["output_tokens_source"] == {"meta_info": 12}
    assert (result["backend"], result["endpoint"], result["max_concurrency"]) == (
        "generate",
        "/generate",
        4,
    )
    assert result["concurrency"] <= 4.0 + 1e-9
    server_e2e = result["server_e2e"]
    assert server_e2e["count"] == 12
    # The server's clock starts after the request arrived and stops before the stream ends.
    assert 0 < server_e2e["mean_server_ms"] < server_e2e["mean_client_ms"]
    assert server_e2e["ratio"] > 1


@pytest.mark.parametrize("concurrency", [None, 3], ids=["unbounded", "limited"])
async def test_openai_backend_at_a_poisson_rate(concurrency: int | None) -> None:
    async with running_server() as server:
        config = small(server.url, backend="openai", request_rate=100.0, concurrency=concurrency)
        result = await run_benchmark(config)
    assert_all_completed(result, config)
    assert result["output_tokens_source"] == {"usage": 12}
    assert (result["model"], result["request_rate"], result["server_e2e"]) == ("sim", 100.0, None)
    starts = [r["start"] for r in result["requests"]]
    if concurrency is None:  # sent in index order, each after its seeded exponential gap
        assert starts == sorted(starts)
        assert starts[-1] - starts[0] > 0.05  # 11 gaps of mean 10 ms
    assert result["concurrency"] <= (concurrency or 12) + 1e-9


async def test_openai_without_usage_counts_one_token_per_chunk() -> None:
    async with running_server() as server:
        extra = {"stream_options": {"include_usage": False}}
        config = small(server.url, backend="openai", concurrency=4, extra_body=extra)
        result = await run_benchmark(config)
    assert_all_completed(result, config)
    assert result["output_tokens_source"] == {"chunks": 12}


@pytest.mark.parametrize("backend", ["generate", "openai"])
async def test_every_failure_is_counted_with_its_reason(backend: str) -> None:
    """Prompts longer than the context: every request is a 400, none is dropped."""
    async with running_server(sim_config(context_length=64)) as server:
        config = small(server.url, backend=backend, input_len=80, concurrency=4)
        result = await run_benchmark(config)
    assert (result["completed"], result["failed"], result["warmup_failed"]) == (0, 12, 2)
    [(reason, count)] = result["failure_reasons"].items()
    assert count == 12
    assert reason.startswith("HTTP 400: ") and "longer than the model's context length" in reason
    assert all(r["error"] == reason for r in result["requests"])
    assert result["median_ttft_ms"] is None and result["request_throughput"] == 0
    table = render_table(result)
    assert "Failed requests:" in table and f"    12  {reason}" in table


async def test_refusals_inside_a_200_stream_are_failures() -> None:
    """With no queue, the server refuses what it cannot run at once, inside a 200 SSE stream
    (an abort finish_reason, as SGLang does): those count as failures next to the successes."""
    config = sim_config(max_running_requests=1, max_queued_requests=0)
    async with running_server(config) as server:
        result = await run_benchmark(small(server.url, concurrency=4, warmup=0))
    assert result["completed"] + result["failed"] == 12
    assert result["failed"] >= 3  # three of the first four find the only slot taken
    [reason] = result["failure_reasons"]
    assert reason == "abort: The request queue is full. (503)"
    assert result["total_output_tokens"] == 8 * result["completed"]


async def test_a_closed_port_fails_every_request() -> None:
    async with running_server() as server:
        async with httpx.AsyncClient() as client:
            workload = await build_workload(
                ServerTokenizer(client, server.url), WorkloadSpec(num_prompts=4, input_len=8)
            )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends; nothing listens
    config = small(f"http://127.0.0.1:{port}", num_prompts=4)
    result = await run_benchmark(config, workload=workload)
    assert (result["completed"], result["failed"], result["warmup_failed"]) == (0, 4, 1)
    [reason] = result["failure_reasons"]
    assert reason.startswith("ConnectError")


async def test_prompts_are_seeded_exact_and_shareable(tmp_path: Path) -> None:
    async with running_server() as server, httpx.AsyncClient() as client:
        tokenizer = ServerTokenizer(client, server.url)
        spec = WorkloadSpec(num_prompts=6, input_len=40, shared_prefix_len=16, seed=7, warmup=2)
        first = await build_workload(tokenizer, spec)
        again = await build_workload(tokenizer, spec)
        other = await build_workload(tokenizer, WorkloadSpec(num_prompts=6, input_len=40, seed=8))
        fewer_warmups = await build_workload(
            tokenizer, WorkloadSpec(num_prompts=6, input_len=40, shared_prefix_len=16, seed=7)
        )
        counts = [len(await tokenizer.tokenize(p.text)) for p in first.prompts]
    assert first == again
    assert first.prompts == fewer_warmups.prompts  # prompt i depends on (seed, i) alone
    assert all(p.tokens == 40 for p in first.prompts) and counts == [40] * 6
    prefix = first.prompts[0].text[:16]
    assert all(p.text.startswith(prefix) for p in first.prompts + first.warmup_prompts)
    assert len({p.text[16:] for p in first.prompts + first.warmup_prompts}) == 8
    assert {p.text for p in other.prompts}.isdisjoint(p.text for p in first.prompts)
    save_workload(first, tmp_path / "prompts.json")
    assert load_workload(tmp_path / "prompts.json") == first


async def test_cli_prints_the_table_and_writes_json_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_server() as server:
        argv = [
            "bench", "--base-url", server.url, "--backend", "openai", "--num-prompts", "8",
            "--input-len", "16", "--output-len", "4", "--concurrency", "2", "--no-progress",
            "--output-json", str(tmp_path / "run.json"), "--plot-dir", str(tmp_path / "plots"),
            "--label", "sim c=2",
        ]  # fmt: skip
        # The CLI runs its own trio.run, so it gets a thread while this loop serves.
        status = await trio.to_thread.run_sync(app_cli.main, argv)
    assert status == 0
    out = capsys.readouterr().out
    assert " sim c=2 " in out and re.search(r"Completed requests:\s+8\n", out)
    result = json.loads((tmp_path / "run.json").read_text())
    assert set(result) == documented_keys()
    assert (result["label"], result["completed"], result["total_output_tokens"]) == (
        "sim c=2",
        8,
        32,
    )
    for name in ("ttft_cdf.png", "e2e_latency_cdf.png"):
        assert (tmp_path / "plots" / name).read_bytes().startswith(PNG)


async def test_cli_exits_1_when_requests_fail(capsys: pytest.CaptureFixture[str]) -> None:
    async with running_server(sim_config(context_length=32)) as server:
        argv = ["bench", "--base-url", server.url, "--num-prompts", "3", "--input-len", "40"]
        status = await trio.to_thread.run_sync(app_cli.main, [*argv, "--no-progress"])
    assert status == 1
    assert re.search(r"Failed requests:\s+3\n", capsys.readouterr().out)


def test_throughput_against_concurrency_plot(tmp_path: Path) -> None:
    results = [
        {"label": server, "max_concurrency": c, "output_throughput": tps * c**0.5}
        for server, tps in (("tributary", 60.0), ("llama-server", 65.0))
        for c in (1, 4, 16)
    ]
    # sglang.bench_serving's own result lines plot beside ours; rate-only runs are left out.
    results += [
        {"backend": "sglang", "max_concurrency": 4, "output_throughput": 100.0},
        {"backend": "sglang", "max_concurrency": None, "output_throughput": 90.0},
    ]
    path = plot_throughput_vs_concurrency(results, tmp_path / "cmp" / "throughput.png")
    assert path.read_bytes().startswith(PNG)
    cdfs = plot_latency_cdfs([{"label": "empty", "requests": []}], tmp_path, prefix="x_")
    assert [p.name for p in cdfs] == ["x_ttft_cdf.png", "x_e2e_latency_cdf.png"]


def test_generate_stream_reads_cumulative_and_incremental_frames() -> None:
    def frames(texts: list[str], ids: list[list[int]]) -> list[str]:
        out = []
        for i, (text, tokens) in enumerate(zip(texts, ids, strict=True)):
            last = i == len(texts) - 1
            meta: dict[str, Any] = {"completion_tokens": i + 1, "prompt_tokens": 5}
            meta["finish_reason"] = {"type": "length", "length": 4} if last else None
            if last:
                meta["e2e_latency"] = 0.5
            out.append(json.dumps({"text": text, "output_ids": tokens, "meta_info": meta}))
        return [*out, "[DONE]"]

    cumulative = frames(["ab", "ab", "abab", "ababa"], [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]])
    incremental = frames(["ab", "", "ab", "a"], [[1], [2], [3], [4]])
    for name, payloads in (("cumulative", cumulative), ("incremental", incremental)):
        record = RequestRecord(index=0, prompt_tokens=0)
        stream = GenerateStream(record)
        for t, payload in enumerate(payloads):
            stream.on_data(payload, now=float(t + 1))
        stream.finish()
        assert record.text == "ababa", name
        assert (record.output_tokens, record.prompt_tokens, record.server_e2e_latency) == (
            4,
            5,
            0.5,
        )
        assert (record.ttft, record.itl) == (1.0, [1.0, 1.0, 1.0]), name


async def test_llama_server_and_vllm_wire_shapes() -> None:
    """llama.cpp's server: `content` in /tokenize and /detokenize, and token counts only in
    `timings`; vLLM: /detokenize answers `prompt`; an `error` event mid-stream fails."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":  # llama-server ignores `prompt`: no tokens
            return httpx.Response(200, json={"tokens": [ord(c) for c in body.get("content", "")]})
        if request.url.path == "/detokenize":
            text = "".join(chr(t) for t in body["tokens"])
            return httpx.Response(200, json={request.url.host: text})
        chunks: list[dict[str, Any]] = [{"choices": [{"text": t}]} for t in ("x", "", "y", "z")]
        if body["prompt"] == "boom":
            chunks[2] = {"error": {"message": "the model crashed", "type": "server_error"}}
        chunks.append(
            {"choices": [{"text": "", "finish_reason": "length"}], "timings": {"predicted_n": 3}}
        )
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode())

    transport = httpx.MockTransport(handler)
    async with httpx.AsyncClient(transport=transport) as client:
        for host in ("content", "prompt"):  # the key each server's /detokenize answers with
            tokenizer = ServerTokenizer(client, f"http://{host}")
            workload = await build_workload(tokenizer, WorkloadSpec(num_prompts=2, input_len=12))
            assert [p.tokens for p in workload.prompts] == [12, 12]
        backend = Backend(
            kind="openai", base_url="http://llama", endpoint="/v1/completions", output_len=3
        )
        ok, failed = (RequestRecord(index=i, prompt_tokens=1) for i in range(2))
        await send_request(client, backend, Prompt("hi", 1), ok)
        await send_request(client, backend, Prompt("boom", 1), failed)
    assert (ok.ok, ok.text, ok.output_tokens) == (True, "xyz", 3)
    assert ok.output_tokens_source == "timings"
    assert len(ok.itl) == 2  # between the three chunks that carry text
    assert (failed.ok, failed.error) == (False, "error event: the model crashed")


def documented_keys() -> set[str]:
    """The top-level keys the JSON section of docs/benchmarks/client.md lists, with
    `{a,b}_{c,d}_ms` rows expanded."""
    section = DOC.read_text().split("## The JSON document", 1)[1].split("\n## ", 1)[0]
    keys: set[str] = set()
    for name in re.findall(r"^\| `([^`]+)`", section, flags=re.MULTILINE):
        parts = [p.split(",") for p in re.split(r"\{([^}]*)\}", name)]
        literal = [[p[0]] if i % 2 == 0 else p for i, p in enumerate(parts)]
        keys.update("".join(combo) for combo in itertools.product(*literal))
    return keys


async def serve_closing_after_each_stream(
    listener: trio.SocketListener, *, answer_every: bool
) -> None:
    """llama-server's habit: one streamed response per connection, then the connection is
    dropped without `Connection: close`. The next request sent on it is read and dropped,
    so the client sees the connection end before any reply (`answer_every=False`: even a
    fresh connection's request is dropped)."""
    sse = 'data: {"choices":[{"text":"ok","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    chunked = f"{len(sse):x}\r\n{sse}\r\n0\r\n\r\n".encode()

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))  # type: ignore[union-attr]
            while len(rest) < length:
                rest += await stream.receive_some(65536)
            if answer_every:
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n" + chunked
                )
                # Keep the connection open long enough for the client to pool and reuse it,
                # then read its next request and drop the connection without a reply.
                await stream.receive_some(65536)

    await trio.serve_listeners(handle, [listener])


@pytest.mark.parametrize("answer_every", [True, False])
async def test_a_request_on_a_connection_the_server_dropped_is_resent_once(
    answer_every: bool,
) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: serve_closing_after_each_stream(listeners[0], answer_every=answer_every)
        )
        backend = Backend(
            kind="openai",
            base_url=f"http://127.0.0.1:{port}",
            endpoint="/v1/completions",
            output_len=1,
            model="m",
        )
        records = [RequestRecord(index=i, prompt_tokens=1) for i in range(4)]
        async with httpx.AsyncClient() as client:
            for record in records:  # one after the other, on one pooled connection
                await send_request(client, backend, Prompt("hi", 1), record)
        nursery.cancel_scope.cancel()
    if answer_every:
        # Every request after the first found its pooled connection dropped, was resent on a
        # new one, and completed; the resend is counted, never hidden.
        assert [(r.ok, r.text, r.retries) for r in records] == [
            (True, "ok", 0),
            (True, "ok", 1),
            (True, "ok", 1),
            (True, "ok", 1),
        ]
    else:
        # A server that drops every request: one resend each, then a counted failure.
        assert all(not r.ok and r.retries == 1 for r in records)
        assert all("without sending a response" in (r.error or "") for r in records)
