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
    """Turns an SSE body's lines into its `data:` payloads (one per event; several `data:`
    lines of one event are joined with newlines, as the SSE spec says)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r")
        if not line:
            if not self._data:
                return None
            payload, self._data = "\n".join(self._data), []
            return payload
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # comments, event:, id: lines carry nothing we use
