"""What a worker's HTTP answer means for the front: which failures may be retried elsewhere,
the message a worker's error body carries (SGLang's `{"error": {...}}`, OpenAI's, vLLM's
`{"object": "error", ...}`, or plain text), and reading a worker's body within a limit.

Every body the front reads from a worker is bounded (`read_limited`, `SSEPayloads`'
`max_event_bytes`): a worker that sends an endless answer costs the front at most the limit,
never its memory (docs/scale-out.md, "Limits and timeouts")."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

import httpx

__all__ = [
    "RETRYABLE_STATUSES",
    "UPSTREAM_FAILURES",
    "AnswerTooLarge",
    "SSEPayloads",
    "SendTracker",
    "counts_against_worker",
    "error_message",
    "error_status",
    "is_retryable_status",
    "lost_failure",
    "read_error_body",
    "read_limited",
    "sent_then_failed",
    "size_text",
    "transport_failure_text",
]

#: Statuses that say "not now, not here" rather than "not this request": another worker may
#: take it. Any other 5xx is a broken worker, also worth another one.
RETRYABLE_STATUSES = frozenset({408, 429})


def is_retryable_status(status: int) -> bool:
    return status >= 500 or status in RETRYABLE_STATUSES


def counts_against_worker(status: int) -> bool:
    """A 5xx is the worker's failure (its breaker hears of it); a 4xx is the client's input
    or the worker being busy (429), not a sign that it is broken."""
    return status >= 500


def error_message(body: bytes | str | Any, status: int) -> str:
    """The human message of a worker's error answer."""
    obj = body
    if isinstance(body, bytes | str):
        try:
            obj = json.loads(body)
        except ValueError:
            text = body.decode(errors="replace") if isinstance(body, bytes) else body
            return text.strip()[:500] or f"HTTP {status}"
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
    return f"HTTP {status}"


def error_status(obj: dict[str, Any], default: int) -> int:
    """The status an error frame carries (`code`), or `default`."""
    err = obj.get("error", obj)
    code = err.get("code") if isinstance(err, dict) else None
    if isinstance(code, int) and 400 <= code <= 599:
        return code
    if isinstance(code, str) and code.isdigit() and 400 <= int(code) <= 599:
        return int(code)
    return default


class AnswerTooLarge(Exception):
    """A worker's body (or one event of its stream) passed the front's limit; the front
    stopped reading it."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"{what} passed the front's limit of {size_text(limit)}")
        self.limit = limit


def size_text(size: int) -> str:
    """`size` bytes for a message: "16 MiB", "64 KiB", "100 bytes"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} bytes"


async def read_limited(chunks: AsyncIterable[bytes], limit: int, *, what: str = "it") -> bytes:
    """A body read from `chunks` (`response.aiter_bytes()`), or `AnswerTooLarge` as soon as
    it passes `limit` bytes (what was read is dropped and the rest is never read)."""
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(what, limit)
        parts.append(chunk)
    return b"".join(parts)


async def read_error_body(response: httpx.Response, limit: int) -> bytes:
    """At most `limit` bytes of an error answer's body: its status is what counts (a 503 is
    retried elsewhere, a 400 is the client's), so an error body past the limit is cut, not
    a failure of its own."""
    parts: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        parts.append(chunk[: limit - size])
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(parts)


class SendTracker:
    """Whether a request's body was written whole, from httpcore's `trace` extension: pass
    `extensions=tracker.extensions` to `client.stream(...)`. httpcore swallows an error
    while writing the body (a worker may answer early, then close) and goes on to read the
    answer, so a failure that follows reads like one after the request was sent; only this
    flag tells the two apart.

    The callback holds a plain list, not this object: httpx's requests and responses end
    up in reference cycles of their own, and whatever they hold waits for the collector."""

    __slots__ = ("_flag", "extensions")

    def __init__(self) -> None:
        self._flag: list[bool] = []
        self.extensions: dict[str, Any] = {"trace": _body_written_into(self._flag)}

    @property
    def sent(self) -> bool:
        return bool(self._flag)


def _body_written_into(flag: list[bool]) -> Callable[[str, dict[str, Any]], Awaitable[None]]:
    async def trace(event: str, info: dict[str, Any]) -> None:
        # "http11.send_request_body.complete", "http2.send_request_body.complete"
        if event.endswith(".send_request_body.complete"):
            flag.append(True)

    return trace


def sent_then_failed(exc: BaseException, *, sent: bool) -> bool:
    """Whether a transport failure came after the worker had the whole request (`sent`: the
    body was written whole, `SendTracker`): the connection dropped (or went silent) while
    the front waited for the answer or read it. The worker may have died *of this request*
    (a grammar that crashes it), so another worker must not get it. A failure to connect or
    to send the whole request is not one of these: the worker never had it, and another may
    take it."""
    return sent and isinstance(exc, httpx.ReadError | httpx.RemoteProtocolError | httpx.ReadTimeout)


class SSEPayloads:
    """Cuts an SSE body, fed in chunks as they arrive, into its events' `data:` payloads
    (several `data:` lines of one event are joined with newlines, as the SSE spec says).
    It works on the bytes as they come (no decoding to str) because orjson parses bytes;
    an event cut between two chunks waits for the rest.

    Linear in the body's size: a chunk that ends no event is appended to the pending event
    and only the new bytes are searched for the end of one (never the whole event again).
    An event that grows past `max_event_bytes` raises `AnswerTooLarge`."""

    def __init__(self, max_event_bytes: int = 16 << 20) -> None:
        self.max_event_bytes = max_event_bytes
        self._pending = bytearray()  # the start of an event whose end has not come
        self._cr = False  # the last chunk ended with "\r" (held back: "\r\n" may be cut)

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._cr:
            chunk = b"\r" + chunk
            self._cr = False
        if chunk.endswith(b"\r"):
            chunk = chunk[:-1]
            self._cr = True
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n")
        pending = self._pending
        if pending:
            start = len(pending) - 1  # "\n\n" may begin at the pending event's last byte
            pending += chunk
            end = pending.find(b"\n\n", start)
            if end < 0:
                self._check(len(pending))
                return []
            last = pending.rfind(b"\n\n")
            events = bytes(pending[:last]).split(b"\n\n")
            del pending[: last + 2]
        else:
            *events, rest = chunk.split(b"\n\n")
            pending += rest
        self._check(len(pending))
        payloads = []
        for event in events:
            data = [
                line[6:] if line.startswith(b"data: ") else line[5:]
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            ]  # comments, event: and id: lines carry nothing a front uses
            if data:
                payloads.append(b"\n".join(data))
        return payloads

    def _check(self, size: int) -> None:
        if size > self.max_event_bytes:
            raise AnswerTooLarge("one event of its stream", self.max_event_bytes)


def transport_failure_text(exc: BaseException) -> str:
    """What went wrong with a worker's connection, for a client: no URL, no address (an
    httpx error's text can hold both, so it goes to the log, not here)."""
    if isinstance(exc, httpx.ConnectTimeout):
        return "it did not accept a connection in time"
    if isinstance(exc, httpx.ConnectError):
        return "it could not be reached (connection refused or failed)"
    if isinstance(exc, httpx.WriteError | httpx.WriteTimeout):
        return "the connection broke while the request was being sent"
    if isinstance(exc, httpx.ReadTimeout):
        return "it sent nothing in time"
    if isinstance(exc, httpx.ReadError | httpx.RemoteProtocolError):
        return "the connection dropped"
    if isinstance(exc, httpx.HTTPError):
        return f"the exchange failed ({type(exc).__name__})"
    if isinstance(exc, ValueError):
        return "it sent a frame that is not JSON"
    return f"it sent an answer the front cannot read ({type(exc).__name__})"


#: Why a request ended after its worker had it (never retried; `/metrics`'
#: `tributary:front_upstream_failures_total{reason}`). dropped: the connection dropped before
#: the worker finished its answer; timeout: the worker sent nothing for `worker_timeout`;
#: too_large: its answer (or one event of its stream) passed the front's limits.
UPSTREAM_FAILURES = ("dropped", "timeout", "too_large")


def lost_failure(
    worker_id: int,
    exc: BaseException,
    *,
    started: bool,
    worker_timeout: float,
    status: int | None = None,
) -> tuple[str, int, str]:
    """(reason, status, client message) of a failure after worker `worker_id` had the
    request (`sent_then_failed`, or `AnswerTooLarge`); `started`: its answer had begun;
    `status`: the worker had answered with this (error) status and failed while its body
    was being read."""
    name = f"Worker {worker_id}"
    if isinstance(exc, AnswerTooLarge):
        return "too_large", 502, f"{name}'s answer was given up: {exc}."
    if isinstance(exc, httpx.ReadTimeout):
        if started:
            when = "mid-answer"
        elif status is not None:
            when = f"after answering {status}, in the middle of its body"
        else:
            when = "before answering"
        message = (
            f"{name} sent nothing for {worker_timeout:g} s ({when}); the request was given up."
        )
        return "timeout", 504, message
    if started:
        return "dropped", 502, f"{name} failed mid-answer: the connection dropped."
    if status is not None:
        message = (
            f"{name} answered {status}, then dropped the connection in the middle of its "
            "body. The request is not retried on another worker: it may be what made the "
            "worker fail."
        )
        return "dropped", 502, message
    message = (
        f"{name} dropped the connection after it had the request, without answering. The "
        "request is not retried on another worker: it may be what made the worker fail."
    )
    return "dropped", 502, message
