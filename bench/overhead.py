"""API overhead: Tributary's HTTP layer on a model that costs nothing, next to the framework floor.

    .venv/bin/python bench/overhead.py [--rounds 3] [--requests 3000] [--idle-streams 1000]

Two servers, each a subprocess on the same Hypercorn settings (`app.server.hypercorn_config`):

- `tributary`: `tributary.open_http_server` over an engine with the sim runner at zero cost
  (`SimLatency(step_base=0, decode_per_seq=0, prefill_per_token=0)`), 64 running slots, so
  every microsecond a request takes is the API's, the scheduler's and the detokenizer's;
- `floor`: a bare `quart_trio.QuartTrio` app served by `hypercorn.trio.serve`, whose POST
  `/generate` parses the JSON body and answers with the very bytes Tributary answered the same
  request with (recorded first): the same-sized JSON body, or for a stream the same SSE events,
  one send each, with the same content type. What Tributary costs beyond it is its own.

Requests are tiny: `/generate` with an 8-byte prompt (8 tokens on the sim) and 4 greedy
output tokens (`ignore_eos`), unary and streaming. The load generator is a separate process:
a lean Trio client on raw sockets (HTTP/1.1 keep-alive, one connection per worker, requests
pre-encoded, responses read by Content-Length or chunked framing), so its cost per request is
a small fraction of the server's; its CPU and the server's are both reported. Each round runs
both servers (order alternating) at concurrency 64 (throughput and latency under load) and 1
(latency alone), after a warm-up.

Then 1,000 idle SSE streams: a Tributary whose sim step takes 5 s (one token per stream
every 5 s; 4,096 tokens asked, so none ends) with 1,024 running slots; the client opens 1,000
connections, each sending one streaming `/generate`, reads the response heads and then
nothing; once the server reports them all admitted (running), its RSS before and after, over
1,000, is the memory per stream. The floor gets the same test with a route that sends the
SSE headers and then sleeps.

Writes docs/benchmarks/overhead.json (the figures the page shows: medians over rounds, the
per-round ratios, the idle test, machine and versions; not every round's measurement) and
overhead.md (keeping the hand-written notes between the `<!-- notes -->` markers).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from page_notes import commands_section, existing_notes, page_header, summary_json

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "benchmarks"
PYTHON = REPO / ".venv" / "bin" / "python"
CLK_TCK = os.sysconf("SC_CLK_TCK")

PROMPT = "Hi there"  # 8 bytes: 8 tokens on the sim runner
MAX_NEW_TOKENS = 4
#: A longer stream, to tell the cost per SSE event from the cost per request.
LONG_TOKENS = 64


#: Idle streams: a token every IDLE_STEP seconds, far more tokens than the test lasts.
IDLE_STEP = 5.0
IDLE_MAX_NEW_TOKENS = 4096


def request_body(stream: bool, max_new_tokens: int = MAX_NEW_TOKENS) -> bytes:
    return json.dumps(
        {
            "text": PROMPT,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
            "stream": stream,
        }
    ).encode()


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 65536) if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


# -- the servers (subprocess roles) -----------------------------------------------------------


def serve_tributary(idle: bool) -> None:
    import trio

    sys.path.insert(0, str(REPO))
    import tributary

    raise_fd_limit()

    async def main() -> None:
        if idle:
            latency = tributary.SimLatency(
                step_base=IDLE_STEP, decode_per_seq=0, prefill_per_token=0
            )
            config = tributary.EngineConfig(
                runner="sim",
                sim_latency=latency,
                max_running_requests=1024,
                max_queued_requests=4096,
            )
        else:
            zero = tributary.SimLatency(step_base=0, decode_per_seq=0, prefill_per_token=0)
            config = tributary.EngineConfig(runner="sim", sim_latency=zero, max_running_requests=64)
        async with tributary.open_engine(config) as eng:
            settings = tributary.ServerSettings(port=0, log_level="warning")
            async with tributary.open_http_server(eng, settings) as urls:
                tributary.settle_heap()  # as `tributary serve` does once serving
                print(urls[0], flush=True)
                await trio.sleep_forever()

    trio.run(main)


def serve_floor(bodies_path: str, idle: bool) -> None:
    """A bare Quart-Trio app on Tributary's Hypercorn settings: the framework floor."""
    import trio
    from hypercorn.trio import serve
    from quart import Response, request
    from quart_trio import QuartTrio

    sys.path.insert(0, str(REPO))
    from tributary.app.heap import settle_heap
    from tributary.app.server import hypercorn_config
    from tributary.app.settings import ServerSettings

    raise_fd_limit()
    bodies = json.loads(Path(bodies_path).read_text())
    unary_body = bodies["unary"]["body"].encode()
    unary_type = bodies["unary"]["content_type"]
    streams = {
        int(n): [e.encode() for e in recorded["events"]]
        for n, recorded in bodies["streams"].items()
    }
    stream_type = bodies["stream_content_type"]
    app = QuartTrio(__name__)

    @app.route("/generate", methods=["POST"])
    async def generate() -> Response:
        body = await request.get_json()
        if not body.get("stream"):
            return Response(unary_body, content_type=unary_type)

        events = streams.get(body["sampling_params"]["max_new_tokens"], [])

        async def frames() -> Any:
            if idle:
                await trio.sleep_forever()
            for event in events:
                yield event

        response = Response(frames(), content_type=stream_type)
        response.timeout = None
        return response

    @app.route("/health", methods=["GET"])
    async def health() -> Response:
        return Response("", content_type="text/plain")

    config = hypercorn_config(ServerSettings(port=0, log_level="warning"))

    async def root() -> None:
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(partial(serve, app, config))
            settle_heap()  # the same collector settings as Tributary's server
            print(urls[0], flush=True)

    trio.run(root)


# -- the lean client (subprocess role) -----------------------------------------------------------


class HttpConnection:
    """One keep-alive HTTP/1.1 connection over a Trio socket stream; no parsing beyond framing."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.stream: Any = None
        self.buf = bytearray()

    async def connect(self) -> None:
        import trio

        self.stream = await trio.open_tcp_stream(self.host, self.port)
        self.buf.clear()

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise ConnectionError("server closed the connection")
        self.buf += data

    async def _read_until(self, marker: bytes) -> bytes:
        while True:
            i = self.buf.find(marker)
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[: i + len(marker)]
                return out
            await self._fill()

    async def _read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def send(self, raw: bytes) -> None:
        if self.stream is None:
            await self.connect()
        await self.stream.send_all(raw)

    async def read_head(self) -> tuple[int, dict[str, str]]:
        head = await self._read_until(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        return status, headers

    async def read_body(self, headers: dict[str, str]) -> bytes:
        """Read the whole body (chunked framing removed)."""
        if "content-length" in headers:
            return await self._read_exact(int(headers["content-length"]))
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int((await self._read_until(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self._read_until(b"\r\n")  # no trailers
                    return b"".join(parts)
                parts.append((await self._read_exact(size + 2))[:-2])
        raise ValueError(f"no framing in {headers}")

    async def close(self) -> None:
        if self.stream is not None:
            with contextlib.suppress(Exception):
                await self.stream.aclose()
            self.stream = None


def raw_request(host: str, port: int, stream: bool, max_new_tokens: int = MAX_NEW_TOKENS) -> bytes:
    body = request_body(stream, max_new_tokens)
    head = (
        f"POST /generate HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def client_load(
    url: str, stream: bool, tokens: int, concurrency: int, requests: int, warmup: int
) -> None:
    """`requests` requests over `concurrency` keep-alive connections; prints a JSON summary."""
    import numpy as np
    import trio

    host, port = url.split("//", 1)[1].rsplit(":", 1)
    raw = raw_request(host, int(port), stream, tokens)

    async def batch(n: int) -> tuple[list[float], int, int, list[str]]:
        latencies: list[float] = []
        errors: list[str] = []
        sizes = events = 0
        remaining = [n]

        async def worker() -> None:
            nonlocal sizes, events
            conn = HttpConnection(host, int(port))
            try:
                while remaining[0] > 0:
                    remaining[0] -= 1
                    t0 = time.perf_counter()
                    try:
                        await conn.send(raw)
                        status, headers = await conn.read_head()
                        body = await conn.read_body(headers)
                        if status != 200:
                            errors.append(f"HTTP {status}")
                        latencies.append(time.perf_counter() - t0)
                        sizes += len(body)
                        events += body.count(b"data: ")
                        if headers.get("connection", "").lower() == "close":
                            await conn.close()
                    except (OSError, ConnectionError, ValueError) as exc:
                        errors.append(f"{type(exc).__name__}: {exc}")
                        await conn.close()
            finally:
                await conn.close()

        async with trio.open_nursery() as nursery:
            for _ in range(min(concurrency, n)):
                nursery.start_soon(worker)
        return latencies, sizes, events, errors

    async def main() -> dict[str, Any]:
        if warmup:
            await batch(warmup)
        # Tell the parent, which samples the server's CPU time at this line and at the end.
        print("measuring", flush=True)
        cpu0, t0 = time.process_time(), time.perf_counter()
        latencies, sizes, events, errors = await batch(requests)
        duration = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        ms = np.array(latencies) * 1000
        return {
            "concurrency": concurrency,
            "stream": stream,
            "tokens": tokens,
            "requests": requests,
            "completed": len(latencies),
            "errors": len(errors),
            "error_samples": sorted(set(errors))[:5],
            "duration_s": duration,
            "requests_per_s": len(latencies) / duration,
            "mean_ms": float(ms.mean()),
            "p50_ms": float(np.percentile(ms, 50)),
            "p90_ms": float(np.percentile(ms, 90)),
            "p99_ms": float(np.percentile(ms, 99)),
            "mean_body_bytes": sizes / max(len(latencies), 1),
            "mean_events": events / max(len(latencies), 1),
            "client_cpu_s": cpu,
            "client_cpu_share": cpu / duration,
            "client_cpu_per_request_us": cpu / max(len(latencies), 1) * 1e6,
        }

    print(json.dumps(trio.run(main)), flush=True)


def client_idle(url: str, n: int, parallel_connects: int) -> None:
    """Open `n` streaming requests and hold them; print 'ready' once every response's head has
    arrived (or 'heads N' with how many did), then hold until stdin closes."""
    import trio

    raise_fd_limit()
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    raw = raw_request(host, int(port), True, IDLE_MAX_NEW_TOKENS)

    async def main() -> None:
        heads = [0]
        failures: list[str] = []
        limiter = trio.CapacityLimiter(parallel_connects)
        all_sent = trio.Event()
        sent = [0]
        conns: list[HttpConnection] = []

        async def one() -> None:
            conn = HttpConnection(host, int(port))
            conns.append(conn)
            try:
                async with limiter:
                    await conn.send(raw)
                sent[0] += 1
                if sent[0] == n:
                    all_sent.set()
                status, _headers = await conn.read_head()
                heads[0] += 1 if status == 200 else 0
                await trio.sleep_forever()
            except (OSError, ConnectionError, ValueError) as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                sent[0] += 1
                if sent[0] == n:
                    all_sent.set()

        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)
            await all_sent.wait()
            with trio.move_on_after(30):
                while heads[0] + len(failures) < n:
                    await trio.sleep(0.1)
            print(
                json.dumps(
                    {
                        "sent": sent[0],
                        "heads": heads[0],
                        "failures": failures[:5],
                        "failed": len(failures),
                    }
                ),
                flush=True,
            )
            # Hold until the parent closes our stdin.
            await trio.to_thread.run_sync(sys.stdin.read)
            nursery.cancel_scope.cancel()
        for conn in conns:
            await conn.close()

    trio.run(main)


# -- orchestration ---------------------------------------------------------------------------


def proc_cpu(pid: int) -> float:
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def machine_busy() -> float:
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = values[:7]
    return (user + nice + system + irq + softirq) / CLK_TCK


def children_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Server:
    def __init__(self, role: list[str], name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [str(PYTHON), __file__, *role],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("http"):
            self.stop()
            raise RuntimeError(f"{name} did not start: {line!r}")
        self.url = line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


#: (mode, output tokens, share of --requests): tiny unary and streaming requests, and a
#: 64-token stream whose extra events give the cost of one SSE event.
MODES = [
    ("unary", MAX_NEW_TOKENS, 1.0),
    ("stream", MAX_NEW_TOKENS, 1.0),
    ("stream-64", LONG_TOKENS, 0.3),
]


def run_load(
    server: Server, stream: bool, tokens: int, concurrency: int, requests: int, warmup: int
) -> dict[str, Any]:
    """One client process; the server's CPU and everybody else's are sampled over exactly the
    measured requests (the client prints a line when its warm-up is over)."""
    client = subprocess.Popen(
        [
            str(PYTHON),
            __file__,
            "_client",
            server.url,
            "--stream" if stream else "--unary",
            str(tokens),
            str(concurrency),
            str(requests),
            str(warmup),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdout is not None
    line = client.stdout.readline().strip()
    if line != "measuring":
        client.wait()
        raise RuntimeError(f"client: {line!r}")
    cpu0, busy0, t0 = proc_cpu(server.proc.pid), machine_busy(), time.perf_counter()
    out = client.stdout.read()
    server_cpu = proc_cpu(server.proc.pid) - cpu0
    busy, wall = machine_busy() - busy0, time.perf_counter() - t0
    if client.wait() != 0:
        raise RuntimeError(f"client failed: {out[-2000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    own = server_cpu + result["client_cpu_s"]  # the client measured its own, in the window
    result["server_cpu_s"] = server_cpu
    result["server_cpu_share"] = server_cpu / wall
    result["server_cpu_per_request_us"] = server_cpu / max(result["completed"], 1) * 1e6
    result["other_cores"] = max(busy - own, 0.0) / wall
    return result


def record_bodies(url: str, path: Path) -> dict[str, Any]:
    """Tributary's answers to the benchmark's requests: what the floor will send back."""
    import httpx

    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        unary = client.post(url + "/generate", content=request_body(False), headers=headers)
        streams = {
            n: client.post(url + "/generate", content=request_body(True, n), headers=headers)
            for n in (MAX_NEW_TOKENS, LONG_TOKENS)
        }
    events = {
        n: [e + "\n\n" for e in r.text.split("\n\n") if e.strip()] for n, r in streams.items()
    }
    bodies = {
        "unary": {"body": unary.text, "content_type": unary.headers["content-type"]},
        "streams": {str(n): {"events": ev} for n, ev in events.items()},
        "stream_content_type": streams[MAX_NEW_TOKENS].headers["content-type"],
    }
    path.write_text(json.dumps(bodies))
    return {
        "unary_bytes": len(unary.content),
        "stream_bytes": {n: len(r.content) for n, r in streams.items()},
        "stream_events": {n: len(ev) for n, ev in events.items()},
        "unary_example": unary.json(),
    }


def idle_streams(server: Server, n: int, tributary_server: bool) -> dict[str, Any]:
    import httpx

    def server_count(running_only: bool = False) -> int | None:
        if not tributary_server:
            return None
        info = httpx.get(server.url + "/get_server_info", trust_env=False, timeout=10).json()
        st = info["internal_states"][0]
        return int(st["running"]) + (0 if running_only else int(st["waiting"]))

    pid = server.proc.pid
    # Warm the code paths: a few streams opened and dropped.
    warm = subprocess.Popen(
        [str(PYTHON), __file__, "_idle", server.url, "16", "16"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert warm.stdout is not None and warm.stdin is not None
    warm.stdout.readline()
    warm.stdin.close()
    warm.wait()
    deadline = time.monotonic() + 30
    while tributary_server and server_count() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    before = proc_rss_kib(pid)
    cpu0 = proc_cpu(pid)
    t0 = time.perf_counter()
    client = subprocess.Popen(
        [str(PYTHON), __file__, "_idle", server.url, str(n), "64"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdout is not None and client.stdin is not None
    opened = json.loads(client.stdout.readline())
    open_s = time.perf_counter() - t0
    counted = None
    deadline = time.monotonic() + 60
    while tributary_server and time.monotonic() < deadline:
        counted = server_count(running_only=True)
        if counted is not None and counted >= opened["heads"]:
            break
        time.sleep(0.5)
    time.sleep(2.0)
    during = proc_rss_kib(pid)
    cpu_open = proc_cpu(pid) - cpu0
    # Idle CPU: what n streams cost while nothing happens.
    cpu1 = proc_cpu(pid)
    time.sleep(5.0)
    idle_cpu_share = (proc_cpu(pid) - cpu1) / 5.0
    client.stdin.close()
    client.wait(timeout=60)
    deadline = time.monotonic() + 30
    left = None
    while tributary_server and time.monotonic() < deadline:
        left = server_count()
        if not left:
            break
        time.sleep(0.5)
    time.sleep(1.0)
    after = proc_rss_kib(pid)
    return {
        "streams": n,
        "client": opened,
        "server_counted": counted,
        "open_all_s": open_s,
        "rss_before_mib": before / 1024,
        "rss_with_streams_mib": during / 1024,
        "rss_after_close_mib": after / 1024,
        "kib_per_stream": (during - before) / max(opened["heads"], 1),
        "server_cpu_opening_s": cpu_open,
        "server_cpu_share_idle": idle_cpu_share,
        "left_after_close": left,
    }


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r["mode"], r["concurrency"]) for r in runs}, key=lambda k: (k[1] == 1, k[0]))
    for mode, c in keys:
        row: dict[str, Any] = {"mode": mode, "concurrency": c}
        per_round: dict[int, dict[str, dict]] = {}
        for r in runs:
            if r["mode"] == mode and r["concurrency"] == c:
                per_round.setdefault(r["round"], {})[r["server"]] = r
        for server in ("tributary", "floor"):
            mine = [pr[server] for pr in per_round.values() if server in pr]
            for key in (
                "requests_per_s",
                "server_cpu_per_request_us",
                "client_cpu_per_request_us",
                "p50_ms",
                "p99_ms",
                "client_cpu_share",
                "server_cpu_share",
                "mean_body_bytes",
                "mean_events",
                "other_cores",
            ):
                row[f"{server}_{key}"] = statistics.median(m[key] for m in mine)
            row[f"{server}_requests_per_s_range"] = [
                min(m["requests_per_s"] for m in mine),
                max(m["requests_per_s"] for m in mine),
            ]
            row[f"{server}_errors"] = sum(m["errors"] for m in mine)
        ratios = [
            pr["tributary"]["requests_per_s"] / pr["floor"]["requests_per_s"]
            for pr in per_round.values()
            if len(pr) == 2
        ]
        row["ratio"] = statistics.median(ratios)
        row["ratio_range"] = [min(ratios), max(ratios)]
        row["ratios"] = ratios  # per round
        for q in ("p50", "p99"):
            added = [
                pr["tributary"][f"{q}_ms"] - pr["floor"][f"{q}_ms"]
                for pr in per_round.values()
                if len(pr) == 2
            ]
            row[f"added_{q}_ms"] = statistics.median(added)
        rows.append(row)
    return rows


def per_event(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Server CPU per SSE event: the 64-token stream against the 4-token one, per concurrency."""
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    out = []
    for (mode, c), long in sorted(by.items(), key=lambda kv: -kv[0][1]):
        short = by.get(("stream", c))
        if mode != "stream-64" or short is None:
            continue
        entry: dict[str, Any] = {"concurrency": c}
        for server in ("tributary", "floor"):
            d_cpu = (
                long[f"{server}_server_cpu_per_request_us"]
                - short[f"{server}_server_cpu_per_request_us"]
            )
            d_events = long[f"{server}_mean_events"] - short[f"{server}_mean_events"]
            entry[f"{server}_events_short"] = short[f"{server}_mean_events"]
            entry[f"{server}_events_long"] = long[f"{server}_mean_events"]
            entry[f"{server}_us_per_event"] = d_cpu / d_events if d_events > 0 else None
        out.append(entry)
    return out


def machine_info() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown",
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("hypercorn", "quart", "quart-trio", "trio", "h11")}


def wait_for_quiet(threshold: float, max_wait: float) -> dict[str, Any]:
    waited = 0.0
    while True:
        busy0, own0, t0 = machine_busy(), children_cpu(), time.perf_counter()
        time.sleep(3.0)
        other = max((machine_busy() - busy0) - (children_cpu() - own0), 0) / (
            time.perf_counter() - t0
        )
        if other < threshold or waited >= max_wait:
            return {
                "other_cores_3s": round(other, 3),
                "waited_s": waited,
                "loadavg": Path("/proc/loadavg").read_text().split()[:3],
            }
        print(f"  machine busy ({other:.2f} cores used by others); waiting", file=sys.stderr)
        time.sleep(12.0)
        waited += 15.0


def quiet_summary(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """What the waits for a quiet machine before the measurements saw, in all."""
    return {
        "count": len(checks),
        "waited_s": sum(c["waited_s"] for c in checks),
        "other_cores_3s_max": max((c["other_cores_3s"] for c in checks), default=None),
    }


MODE_NAMES = {
    "unary": f"unary, {MAX_NEW_TOKENS} tokens",
    "stream": f"stream, {MAX_NEW_TOKENS} tokens",
    "stream-64": f"stream, {LONG_TOKENS} tokens",
}


def fmt_us(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def render_markdown(doc: dict[str, Any], notes: str) -> str:
    cfg = doc["config"]
    lines = [
        *page_header(
            "API overhead: Tributary on a zero-cost model, next to the framework floor",
            script="bench/overhead.py",
            recipe="just bench-overhead",
            raw="overhead.json",
            doc=doc,
            notes=notes,
        ),
        "## Requests per second and latency",
        "",
        f"`/generate`, {len(PROMPT.encode())}-token prompt, {MAX_NEW_TOKENS} greedy tokens "
        f"(`ignore_eos`), and a {LONG_TOKENS}-token stream; {cfg['requests']} requests per "
        f"measurement at concurrency {cfg['concurrency']} after {cfg['warmup']} warm-up, "
        f"{cfg['requests_c1']} at concurrency 1 (30% of those for the {LONG_TOKENS}-token "
        "stream). The floor answers with the bytes Tributary sent for the same request: "
        f"{doc['bodies']['unary_bytes']} bytes unary; streams of "
        + ", ".join(
            f"{n} tokens: {b} bytes in {doc['bodies']['stream_events'][n]} events"
            for n, b in doc["bodies"]["stream_bytes"].items()
        )
        + ". Medians "
        "over rounds; `ratio` is Tributary's requests/s over the floor's, per round (range in "
        "brackets); `added` is Tributary's latency minus the floor's.",
        "",
        "| mode | conc. | Tributary req/s | floor req/s | ratio | Tributary p50 / p99 (ms) "
        "| floor p50 / p99 (ms) | added p50 / p99 (ms) | server CPU µs/request (T / floor) "
        "| client CPU share (T / floor) |",
        "|---|---:|---:|---:|---:|---|---|---|---|---|",
    ]
    for r in doc["summary"]:
        lines.append(
            f"| {MODE_NAMES[r['mode']]} | {r['concurrency']} | "
            f"{r['tributary_requests_per_s']:.0f} | "
            f"{r['floor_requests_per_s']:.0f} | {r['ratio']:.2f} [{r['ratio_range'][0]:.2f}, "
            f"{r['ratio_range'][1]:.2f}] | "
            f"{r['tributary_p50_ms']:.2f} / {r['tributary_p99_ms']:.2f} | "
            f"{r['floor_p50_ms']:.2f} / {r['floor_p99_ms']:.2f} | "
            f"{r['added_p50_ms']:+.2f} / {r['added_p99_ms']:+.2f} | "
            f"{r['tributary_server_cpu_per_request_us']:.0f} / "
            f"{r['floor_server_cpu_per_request_us']:.0f} | "
            f"{r['tributary_client_cpu_share']:.0%} / {r['floor_client_cpu_share']:.0%} |"
        )
    lines += [
        "",
        "Server CPU is the server process's CPU time over the measured requests, per request;",
        "the client's share is of one core over the same window. Each server runs on one Trio",
        "thread: at concurrency 64 its share of a core is "
        + ", ".join(
            f"{r['mode']} {r['tributary_server_cpu_share']:.0%} (Tributary) / "
            f"{r['floor_server_cpu_share']:.0%} (floor)"
            for r in doc["summary"]
            if r["concurrency"] == cfg["concurrency"]
        )
        + ", while the client's stays far lower: the server sets the pace.",
        "",
        "## The cost of one SSE event",
        "",
        f"Server CPU per request of the {LONG_TOKENS}-token stream minus that of the "
        f"{MAX_NEW_TOKENS}-token one, over the difference in events the client received (the "
        "engine coalesces tokens that wait while a frame is being sent, so events per stream "
        "vary with load; the floor replays a fixed recording):",
        "",
        "| conc. | Tributary events/stream (4 / 64 tokens) | Tributary µs/event "
        "| floor events/stream | floor µs/event |",
        "|---:|---|---:|---|---:|",
        *[
            f"| {e['concurrency']} | {e['tributary_events_short']:.1f} / "
            f"{e['tributary_events_long']:.1f} | {fmt_us(e['tributary_us_per_event'])} | "
            f"{e['floor_events_short']:.1f} / {e['floor_events_long']:.1f} | "
            f"{fmt_us(e['floor_us_per_event'])} |"
            for e in doc.get("per_event", [])
        ],
        "",
        "## Idle SSE streams",
        "",
        "| server | streams open | RSS before (MiB) | with streams (MiB) | per stream (KiB) "
        "| after close (MiB) | server CPU while idle |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in doc["idle"].items():
        lines.append(
            f"| {name} | {r['client']['heads']} | {r['rss_before_mib']:.1f} | "
            f"{r['rss_with_streams_mib']:.1f} | {r['kib_per_stream']:.1f} | "
            f"{r['rss_after_close_mib']:.1f} | {r['server_cpu_share_idle']:.1%} |"
        )
    lines += [
        "",
        "## Target (issue 8)",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    for r in doc["summary"]:
        if r["concurrency"] == cfg["concurrency"] and r["mode"] != "stream-64":
            lines.append(
                f"| `/generate` {r['mode']} at concurrency {r['concurrency']}: "
                f">= 0.8 of the floor's requests/s | {r['ratio']:.2f} | "
                f"{'yes' if r['ratio'] >= 0.8 else '**no**'} |"
            )
    lines += commands_section("just bench-overhead", "bench/overhead.py", cfg["argv"])
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        role, rest = sys.argv[1], sys.argv[2:]
        if role == "_serve_tributary":
            serve_tributary(idle=rest == ["--idle"])
        elif role == "_serve_floor":
            serve_floor(rest[0], idle=rest[1:] == ["--idle"])
        elif role == "_client":
            url, mode, tokens, c, n, w = rest
            client_load(url, mode == "--stream", int(tokens), int(c), int(n), int(w))
        elif role == "_idle":
            client_idle(rest[0], int(rest[1]), int(rest[2]))
        return

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=3000, help="per measurement at --concurrency")
    p.add_argument("--requests-c1", type=int, default=1000, help="per measurement at 1")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--idle-streams", type=int, default=1000)
    p.add_argument("--quiet-threshold", type=float, default=0.15)
    p.add_argument("--quiet-wait", type=float, default=600.0)
    p.add_argument("--output", type=Path, default=DOCS / "overhead.json")
    p.add_argument("--markdown", type=Path, default=DOCS / "overhead.md")
    args = p.parse_args()

    started = datetime.datetime.now(datetime.UTC)
    runs: list[dict[str, Any]] = []
    quiet_log = []
    with tempfile.TemporaryDirectory(prefix="tributary-overhead-") as tmp:
        bodies_path = Path(tmp) / "bodies.json"
        trib = Server(["_serve_tributary"], "tributary")
        try:
            bodies = record_bodies(trib.url, bodies_path)
            floor = Server(["_serve_floor", str(bodies_path)], "floor")
            try:
                for round_no in range(1, args.rounds + 1):
                    order = [trib, floor] if round_no % 2 else [floor, trib]
                    for mode, tokens, scale in MODES:
                        for c, n, w in (
                            (args.concurrency, args.requests, args.warmup),
                            (1, args.requests_c1, 50),
                        ):
                            n = max(int(n * scale), 100)
                            for server in order:
                                quiet_log.append(
                                    wait_for_quiet(args.quiet_threshold, args.quiet_wait)
                                )
                                r = run_load(server, mode != "unary", tokens, c, n, w)
                                r |= {"server": server.name, "mode": mode, "round": round_no}
                                runs.append(r)
                                print(
                                    f"[round {round_no}] {server.name:9s} {mode:9s} c={c:<3d} "
                                    f"{r['requests_per_s']:7.0f} req/s  p50 {r['p50_ms']:6.2f} "
                                    f"p99 {r['p99_ms']:6.2f} ms  errors {r['errors']}  "
                                    f"client {r['client_cpu_share']:.0%}  server "
                                    f"{r['server_cpu_share']:.0%}  others {r['other_cores']:.2f}",
                                    file=sys.stderr,
                                    flush=True,
                                )
            finally:
                floor.stop()
        finally:
            trib.stop()

        idle: dict[str, Any] = {}
        if args.idle_streams:
            wait_for_quiet(args.quiet_threshold, args.quiet_wait)
            server = Server(["_serve_tributary", "--idle"], "tributary")
            try:
                idle["tributary"] = idle_streams(server, args.idle_streams, True)
            finally:
                server.stop()
            server = Server(["_serve_floor", str(bodies_path), "--idle"], "floor")
            try:
                idle["floor"] = idle_streams(server, args.idle_streams, False)
            finally:
                server.stop()
            for name, r in idle.items():
                print(
                    f"idle {name}: {r['client']['heads']} streams, {r['kib_per_stream']:.1f} KiB "
                    f"each ({r['rss_before_mib']:.1f} -> {r['rss_with_streams_mib']:.1f} MiB)",
                    file=sys.stderr,
                )

    summary = summarize(runs)
    events = per_event(summary)
    doc = {
        "benchmark": "overhead",
        "date": started.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "versions": versions(),
        "config": {
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "requests": args.requests,
            "requests_c1": args.requests_c1,
            "warmup": args.warmup,
            "prompt": PROMPT,
            "max_new_tokens": MAX_NEW_TOKENS,
            "argv": " ".join(sys.argv[1:]),
        },
        "bodies": bodies,
        "summary": summary,
        "per_event": events,
        "idle": idle,
        "quiet_checks": quiet_summary(quiet_log),
    }
    args.output.write_text(summary_json(doc))
    args.markdown.write_text(render_markdown(doc, existing_notes(args.markdown)))
    for r in summary:
        print(f"{r['mode']} c={r['concurrency']}: ratio {r['ratio']:.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
