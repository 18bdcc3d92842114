"""`RequestRecord`: one engine request as it ended, all that /metrics and the access log read.

Synopsis::

    record = timing.record()            # frozen; taken as the HTTP exchange ends
    if record.answered: ...             # exchange.py decides what counts, once
    metrics.observe_finished(record)    # /metrics
    access_fields(exchange, status, record, log_requests)   # the access log line

A record is a tuple of plain values, built once per request: it refers to no live object of
the request (its timing, exchange or stream), so whoever keeps it keeps nothing else alive.
"""

from __future__ import annotations

from typing import NamedTuple

from tributary.engine import GenerateRequest

__all__ = ["RequestRecord"]


class RequestRecord(NamedTuple):
    #: The request id (a batch item's own); None where none was given (a relayed chat).
    rid: str | None
    #: What was asked (for `--log-requests`); None for a relayed chat.
    request: GenerateRequest | None
    prompt_tokens: int
    #: As the response reports them; for a request that never finished, what it had produced.
    completion_tokens: int
    cached_tokens: int
    #: The finish reason's type, "error" for a failure, None if it never finished;
    #: "tool_calls" for a stop whose answer was read into tool calls (as the response says).
    finish: str | None
    #: Seconds from the request's start (`RequestTiming.start`); None where it did not happen.
    e2e_latency: float | None
    queue_time: float | None
    time_to_first_token: float | None
    #: It ended with an answer: a `Done` that is no abort, a relayed answer that is no
    #: failure, or a streamed request the full queue refused (SGLang's 200 abort frame).
    answered: bool
    #: Part of one answer with the other requests of its exchange (a `/v1` response: any
    #: choice's failure fails the whole response), so counted all or none.
    whole: bool
