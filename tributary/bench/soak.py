"""A disconnect soak: many raw-socket clients, every request shape, a random share of them
closing at a random moment; then the server must hold nothing.

Synopsis::

    jobs = plan_jobs(1000, seed=1)
    result = await run_soak(jobs, urls, concurrency=48)    # urls: cumulative / incremental
    result.failures          # [] when every client that stayed got a complete, correct answer
    live_tasks()             # every task of this Trio run, to compare before and after

Used by `tests/app/test_soak.py` (sim model, in CI) and `bench/soak.py` (the real model).

Clients speak HTTP/1.1 through h11 over plain Trio sockets with `Connection: close`, so the
moment of a close is exact and nothing is left on an idle keep-alive connection:

- `complete`: read the whole answer and check it (counts, finish reasons, `[DONE]`);
- `before_body`: send the headers and half the body, then close;
- `after_send`: send the whole request, close 0-20 ms later (queued, or mid-prefill);
- `mid_response`: close after 1-3 SSE events (mid-decode), or 5-40 ms into a unary request;
- `after_last_byte`: read the whole answer, then reset the connection.

Half the closes are resets (SO_LINGER 0), half ordinary FINs.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import h11
import trio

__all__ = [
    "KINDS",
    "MOMENTS",
    "Job",
    "SoakResult",
    "live_tasks",
    "plan_jobs",
    "rss_mib",
    "run_soak",
]

KINDS = (
    "generate",
    "generate_batch",
    "generate_stream",
    "generate_stream_batch",
    "generate_stream_incremental",
    "completions",
    "completions_stream",
    "chat_stream",
)
MOMENTS = ("before_body", "after_send", "mid_response", "after_last_byte")
#: Prompts are this long on average: long enough that prefill takes a step of its own.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@dataclasses.dataclass(frozen=True)
class Job:
    kind: str
    moment: str  # "complete" or one of MOMENTS
    max_new: int
    delay: float  # seconds, for the timed moments
    events: int  # SSE events to read before `mid_response` closes a stream
    reset: bool  # close with RST instead of FIN
    prompt: str = PROMPT

    @property
    def streams(self) -> bool:
        return "stream" in self.kind

    def request(self) -> tuple[str, dict[str, Any]]:
        """(path, JSON body)."""
        greedy = {"temperature": 0, "max_new_tokens": self.max_new, "ignore_eos": True}
        if self.kind.startswith("generate"):
            batch = "batch" in self.kind
            return "/generate", {
                "text": [self.prompt, self.prompt[::-1]] if batch else self.prompt,
                "sampling_params": greedy,
                "stream": self.streams,
            }
        openai: dict[str, Any] = {
            "max_tokens": self.max_new,
            "temperature": 0,
            "ignore_eos": True,
        }
        if self.streams:
            openai |= {"stream": True, "stream_options": {"include_usage": True}}
        if self.kind == "chat_stream":
            return "/v1/chat/completions", {
                "messages": [{"role": "user", "content": self.prompt}],
                **openai,
            }
        return "/v1/completions", {"prompt": self.prompt, **openai}


def plan_jobs(
    count: int,
    *,
    seed: int,
    disconnect_share: float = 0.4,
    max_new: tuple[int, int] = (4, 40),
    leaving_max_new: int = 2000,
    kinds: Sequence[str] = KINDS,
    prompt: str = PROMPT,
) -> list[Job]:
    """`count` jobs, the same for the same seed. A client that leaves while its request runs
    (`after_send`, `mid_response`) asks for `leaving_max_new` tokens: if its request were not
    aborted, the engine would be busy long after the soak (the check that catches it)."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        moment = rng.choice(MOMENTS) if rng.random() < disconnect_share else "complete"
        tokens = rng.randint(*max_new)
        jobs.append(
            Job(
                kind=rng.choice(kinds),
                moment=moment,
                max_new=leaving_max_new if moment in ("after_send", "mid_response") else tokens,
                delay=rng.uniform(0.0, 0.04),
                events=rng.randint(1, 3),
                reset=rng.random() < 0.5,
                prompt=prompt,
            )
        )
    return jobs


@dataclasses.dataclass
class SoakResult:
    #: Requests per (kind, moment).
    counts: collections.Counter[tuple[str, str]] = dataclasses.field(
        default_factory=collections.Counter
    )
    #: What was wrong with the answers of clients that stayed to the end.
    failures: list[str] = dataclasses.field(default_factory=list)
    #: Clients that meant to stay but whose answer had ended before they could leave early
    #: (counted as completed and checked).
    ended_before_leaving: int = 0

    @property
    def requests(self) -> int:
        return sum(self.counts.values())

    @property
    def disconnects(self) -> int:
        return sum(n for (_, moment), n in self.counts.items() if moment != "complete")


async def run_soak(
    jobs: Sequence[Job],
    urls: Mapping[str, str],
    *,
    concurrency: int = 48,
    answer_timeout: float = 60.0,
) -> SoakResult:
    """Run `jobs` with `concurrency` clients. `urls["cumulative"]` serves every kind but
    `generate_stream_incremental`, which goes to `urls["incremental"]` (a server with
    incremental streaming output on the same engine). A client that stays and has no
    complete answer within `answer_timeout` seconds is an AssertionError."""
    result = SoakResult()
    queue = list(reversed(jobs))

    async def client() -> None:
        while queue:
            job = queue.pop()
            url = urls["incremental" if job.kind.endswith("incremental") else "cumulative"]
            result.counts[job.kind, job.moment] += 1
            failure = await _exchange(job, url, result, answer_timeout)
            if failure is not None:
                result.failures.append(f"{job}: {failure}")

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    return result


async def _exchange(job: Job, url: str, result: SoakResult, answer_timeout: float) -> str | None:
    path, body = job.request()
    raw = json.dumps(body).encode()
    parts = urlsplit(url)
    conn = h11.Connection(h11.CLIENT)
    head = conn.send(
        h11.Request(
            method="POST",
            target=path,
            headers=[
                ("host", parts.netloc),
                ("content-type", "application/json"),
                ("content-length", str(len(raw))),
                ("connection", "close"),
            ],
        )
    )
    stream = await trio.open_tcp_stream(parts.hostname or "127.0.0.1", parts.port or 80)
    try:
        if job.moment == "before_body":
            await stream.send_all((head or b"") + raw[: len(raw) // 2])
            return None
        await stream.send_all((head or b"") + raw)
        if job.moment == "after_send":
            await trio.sleep(job.delay * 0.5)
            return None
        status, chunks, finished = await _read(job, conn, stream, answer_timeout)
        if not finished:
            return None  # left mid-response, as planned
        if job.moment == "mid_response":
            result.ended_before_leaving += 1
        return _check(job, status, b"".join(chunks))
    finally:
        if job.reset:
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()


async def _read(
    job: Job, conn: h11.Connection, stream: trio.SocketStream, answer_timeout: float
) -> tuple[int, list[bytes], bool]:
    """Read the answer; (status, body chunks, whether it was read to its end)."""
    status = 0
    chunks: list[bytes] = []
    leave_after = job.events if job.moment == "mid_response" and job.streams else None
    leaves_unary = job.moment == "mid_response" and not job.streams
    timeout = job.delay + 0.005 if leaves_unary else answer_timeout
    with trio.move_on_after(timeout):
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
                if leave_after is not None and b"".join(chunks).count(b"\n\n") >= leave_after:
                    return status, chunks, False
            elif isinstance(event, h11.EndOfMessage):
                return status, chunks, True
            elif isinstance(event, h11.ConnectionClosed):
                return status, chunks, False
    if job.moment != "mid_response":
        raise AssertionError(f"no complete answer within {timeout} s: {job}")
    return status, chunks, False


def _events(body: bytes) -> list[Any]:
    payloads = [
        block[len(b"data: ") :] for block in body.split(b"\n\n") if block.startswith(b"data: ")
    ]
    return [p.decode() if p == b"[DONE]" else json.loads(p) for p in payloads]


def _check(job: Job, status: int, body: bytes) -> str | None:
    """What is wrong with a complete answer, or None."""
    if status != 200:
        return f"status {status}: {body[:300]!r}"
    n = job.max_new
    if not job.streams:
        answer = json.loads(body)
        if job.kind == "completions":
            ok = answer["usage"]["completion_tokens"] == n
            ok &= answer["choices"][0]["finish_reason"] == "length"
        else:
            items = answer if isinstance(answer, list) else [answer]
            ok = len(items) == (2 if "batch" in job.kind else 1) and all(
                i["meta_info"]["completion_tokens"] == n
                and i["meta_info"]["finish_reason"] == {"type": "length", "length": n}
                for i in items
            )
        return None if ok else f"wrong answer: {body[:400]!r}"
    events = _events(body)
    if not events or events[-1] != "[DONE]":
        return f"stream not ended by [DONE]: {body[-300:]!r}"
    frames = events[:-1]
    if any("error" in f for f in frames):
        return f"error event: {body[-300:]!r}"
    if job.kind.startswith("generate"):
        ids: dict[int, int] = collections.defaultdict(int)
        last: dict[int, Any] = {}
        for frame in frames:
            index = frame.get("index", 0)
            if job.kind.endswith("incremental"):
                ids[index] += len(frame["output_ids"])
            else:
                ids[index] = len(frame["output_ids"])
            last[index] = frame["meta_info"]
        count = 2 if "batch" in job.kind else 1
        ok = sorted(last) == list(range(count)) and all(
            ids[i] == n and last[i]["finish_reason"] == {"type": "length", "length": n}
            for i in range(count)
        )
    else:
        usage = frames[-1].get("usage") or {}
        finishes = [c["finish_reason"] for f in frames for c in f["choices"] if c["finish_reason"]]
        ok = usage.get("completion_tokens") == n and finishes == ["length"]
    return None if ok else f"wrong stream: {body[-400:]!r}"


def live_tasks() -> list[str]:
    """The names of every task of the running Trio program (to compare before and after)."""
    names = []
    root = trio.lowlevel.current_root_task()
    stack = [root] if root is not None else []
    while stack:
        task = stack.pop()
        names.append(task.name)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return sorted(names)


def rss_mib() -> float:
    """This process's resident set size, in MiB (Linux)."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
