"""Per-request limits: how large a body may be and how long a request may take.

Synopsis::

    header = request.headers.get(TIMEOUT_HEADER)
    deadline = Deadline.for_request(settings, header)    # BadRequest for a bad header
    with deadline.applied():                             # RequestTimedOut if it passes here
        body = await read_json_body()                    # RequestTooLarge past the limit
    streams = await submit_all(engine, items, deadline)  # each stream ends by it

Body size (`ServerSettings.max_request_bytes`, `--max-request-bytes`): Quart's
`MAX_CONTENT_LENGTH`, which `create_app` sets. Measured on Quart 0.22 / Quart-Trio 0.12 over
real sockets (tests/app/test_limits_wire.py): a declared Content-Length past the limit is
refused before any body byte is read; a chunked body is counted as it arrives, buffering stops
at the limit and the view's read fails at once, so the 413 leaves while the client is still
sending. `read_json_body` turns Quart's error into `RequestTooLarge`, whose message names the
limit.

Deadlines (`ServerSettings.request_timeout`, `--request-timeout`, and the `X-Request-Timeout`
header): the whole HTTP request, from the moment its view starts (reading the body included)
to its terminal output. Each engine stream waits for its next item in a Trio cancel scope
with that deadline (`RequestStream.set_deadline`), so no task polls: at the deadline every
unfinished item is aborted at once and ends with a 408 abort, which each response shape
reports as it reports any abort with a status (`errors.py`). The header may shorten the
server's timeout, never lengthen it: an operator's `--request-timeout` is a cap.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager

import trio

from tributary.engine import BadRequest, EngineError, RequestStream

from ..settings import ServerSettings

__all__ = ["TIMEOUT_HEADER", "Deadline", "RequestTimedOut", "RequestTooLarge"]

#: The per-request override of `--request-timeout`, in seconds (SGLang has none).
TIMEOUT_HEADER = "X-Request-Timeout"


class RequestTooLarge(EngineError):
    http_status = 413
    err_type = "request_too_large"

    def __init__(self, limit: int | None) -> None:
        super().__init__(
            f"The request body is larger than this server accepts ({limit} bytes, "
            "--max-request-bytes)."
        )


class RequestTimedOut(EngineError):
    http_status = 408
    err_type = "timeout"


@dataclasses.dataclass(frozen=True)
class Deadline:
    #: The request's time budget in seconds; None when it has none.
    seconds: float | None
    #: When it runs out, on Trio's clock (inf without a budget).
    at: float

    @classmethod
    def for_request(cls, settings: ServerSettings, raw: str | None) -> Deadline:
        """The deadline of a request arriving now, given its `X-Request-Timeout` header (None
        when absent): the header's seconds, capped by the server's timeout; the server's
        alone without the header. A header that is not a positive, finite number of seconds
        is a `BadRequest`."""
        seconds = settings.request_timeout
        if raw is not None:
            given = _seconds(raw)
            seconds = given if seconds is None else min(seconds, given)
        if seconds is None:
            return cls(None, math.inf)
        return cls(seconds, trio.current_time() + seconds)

    @property
    def message(self) -> str:
        return f"Request timed out after {self.seconds:g} s."

    def bound(self, streams: list[RequestStream]) -> None:
        """Make each stream end by this deadline (a 408 abort)."""
        if self.seconds is None:
            return
        for stream in streams:
            stream.set_deadline(self.at, message=self.message)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Run the block within the deadline; `RequestTimedOut` if it passes there."""
        if self.seconds is None:  # no deadline: no cancel scope to pay for
            yield
            return
        with trio.move_on_at(self.at) as scope:
            yield
        if scope.cancelled_caught:
            raise RequestTimedOut(self.message)


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise BadRequest(
            f"{TIMEOUT_HEADER} must be a positive number of seconds, got {raw.strip()!r}."
        )
    return value
