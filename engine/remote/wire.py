"""What a worker's HTTP answer means for the front: which failures may be retried elsewhere,
and the message a worker's error body carries (SGLang's `{"error": {...}}`, OpenAI's, vLLM's
`{"object": "error", ...}`, or plain text)."""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "RETRYABLE_STATUSES",
    "SSEPayloads",
    "counts_against_worker",
    "error_message",
    "error_status",
    "is_retryable_status",
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


class SSEPayloads:
    """Cuts an SSE body, fed in chunks as they arrive, into its events' `data:` payloads
    (several `data:` lines of one event are joined with newlines, as the SSE spec says).
    It works on the bytes as they come (one split per chunk, no decoding to str) because
    orjson parses bytes; an event cut between two chunks waits for the rest."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buffer = self._buffer + chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        *events, self._buffer = buffer.split(b"\n\n")
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
