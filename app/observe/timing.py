"""`RequestTiming`: each request measures itself, on Trio's clock, and hands over a record.

Synopsis::

    timing = RequestTiming.start(exchange)     # after normalization, before tokenization/submit
    item = timing.for_item(stream, request)    # one per engine request (batch items share start)
    ...                                        # for every engine item, the moment it arrives:
    item.observe(output)                       # first output, inter-token gaps, terminal
    meta_info["e2e_latency"] = item.e2e_latency
    record = item.record()                     # frozen: what /metrics and the access log read

This is SGLang's boundary (the Rust server's `RequestTiming`, Python's `created_time` in
`_init_req_state`): the latency excludes HTTP parsing and body validation, and includes
tokenization, queueing, prefill, decode and detokenization up to the terminal output. Under
`autojump_clock` the numbers are exact virtual times. A batch shares one start instant
(`for_item`), while each item finishes on its own.

The engine stamps each `Done` with when the request was admitted to a running slot and when
its first token was sampled (same clock), so the phases below all share `e2e_latency`'s start
(docs/operations.md defines them).

Who observes: a `RequestSink` (the HTTP exchange, `Exchange`) is handed each item as it
begins, and takes the item's `RequestRecord` when it is done with it (as the exchange ends,
where it decides what counts in /metrics and writes the access log). An item holds no
reference to its sink, only to where its inter-token gaps go as they happen (`LatencySink`:
`Metrics`), so a finished request is freed by reference counting, never left in a cycle. The
same numbers build the response: a dashboard, a log line and a response never disagree.
"""

from __future__ import annotations

from typing import Any, Protocol

import trio

from tributary.engine import (
    Done,
    Error,
    FinishReason,
    GenerateRequest,
    Output,
    RequestStream,
    SpecCounts,
)

from ..http.errors import abort_status
from .record import RequestRecord

__all__ = ["LatencySink", "RequestSink", "RequestTiming"]


class LatencySink(Protocol):
    """Where a request's inter-token gaps go, the moment they happen (`Metrics`)."""

    def observe_inter_token_latency(self, interval: float, tokens: int) -> None: ...


class RequestSink(Protocol):
    """Who observes a request's items (`Exchange`)."""

    @property
    def metrics(self) -> LatencySink | None:
        """Where each item's inter-token gaps go (None: nowhere)."""
        ...

    def begin(self, item: RequestTiming) -> None:
        """`item` began: keep it, and take its `record()` once done with it."""
        ...


class RequestTiming:
    def __init__(
        self, created_at: float, sink: RequestSink | None = None, *, whole: bool = False
    ) -> None:
        self.created_at = created_at
        #: Where `for_item` hands each item (a request's timing holds it; an item does not).
        self._sink = sink
        self._latencies = sink.metrics if sink is not None else None
        #: Its items are one answer (`RequestRecord.whole`).
        self.whole = whole
        self.first_output_at: float | None = None
        self.finished_at: float | None = None
        #: From the engine's `Done`.
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        #: What a remote worker measured for its part (None: served locally).
        self.worker_e2e_latency: float | None = None
        #: Its speculative decoding, from the engine's `Done` (None: it did not speculate).
        self.speculative: SpecCounts | None = None
        #: What the item was and how it ended (for metrics and the access log).
        self.rid: str | None = None
        self.request: GenerateRequest | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.failed = False  # ended with an `Error` item
        self.answered = False  # ended with an answer (`RequestRecord.answered`)
        #: Its answer was read into tool calls (set by the view; `finish` is "tool_calls").
        self.called_tools = False
        self._last_output_at = 0.0
        self._last_tokens = 0

    @classmethod
    def start(cls, sink: RequestSink | None = None, *, whole: bool = False) -> RequestTiming:
        """A request's timing, starting now. `whole`: its items are one answer, counted in
        /metrics all or none (a `/v1` response, which any choice's failure fails)."""
        return cls(trio.current_time(), sink, whole=whole)

    def for_item(
        self, stream: RequestStream | None = None, request: GenerateRequest | None = None
    ) -> RequestTiming:
        """A fresh timing for one engine request, sharing this request's start instant,
        handed to the sink (if any), which takes its record when the HTTP exchange ends."""
        item = RequestTiming(self.created_at, whole=self.whole)
        item._latencies = self._latencies
        if stream is not None:
            item.rid = stream.rid
            item.prompt_tokens = stream.prompt_tokens
        item.request = request
        if self._sink is not None:
            self._sink.begin(item)
        return item

    def observe(self, item: Output) -> None:
        """Record one engine item, the moment it arrives. The terminal one (`Done` or `Error`)
        ends the request; a `Done` that is no abort is an answer."""
        now = trio.current_time()
        if isinstance(item, Error):
            self.failed = True
            self.finish()
            return
        tokens = item.completion_tokens
        # So far (the access log of a request whose client left reports what it got).
        self.completion_tokens = tokens
        if self.first_output_at is None:
            self.first_output_at = now
            self._last_output_at, self._last_tokens = now, tokens
        elif tokens > self._last_tokens:
            if self._latencies is not None:
                self._latencies.observe_inter_token_latency(
                    now - self._last_output_at, tokens - self._last_tokens
                )
            self._last_output_at, self._last_tokens = now, tokens
        if isinstance(item, Done):
            self.finished_at = now
            self.prompt_tokens = item.prompt_tokens
            self.cached_tokens = item.cached_tokens
            self.finish_reason = item.finish_reason
            self.admitted_at = item.admitted_at
            self.first_token_at = item.first_token_at
            self.worker_e2e_latency = item.worker_e2e_latency
            self.speculative = item.speculative
            self.answered = abort_status(item.finish_reason) is None

    def refused(self, reason: FinishReason) -> None:
        """Ended before it ran, with SGLang's 200 abort frame of a full queue (`reason`): an
        answer that carries `e2e_latency`, so counted as one."""
        self.finish()
        self.finish_reason = reason
        self.answered = True

    def relayed_output(self) -> None:
        """A relayed answer's first bytes reached the front (`app/openai/relay.py`): its first
        output and, as far as the front can see, its first token."""
        if self.first_output_at is None:
            self.first_output_at = self.first_token_at = trio.current_time()

    def relayed_end(self, *, answered: bool) -> None:
        """A relayed answer ended: with an answer, or with a failure (an error status, a
        broken stream, an error event, the deadline)."""
        if self.finished_at is None:
            self.finish()
            self.answered = answered
            self.failed = not answered

    def finish(self) -> None:
        if self.finished_at is None:
            self.finished_at = trio.current_time()

    def record(self) -> RequestRecord:
        """What this request measured, frozen: final once it has ended, else so far."""
        created = self.created_at
        return RequestRecord(
            self.rid,
            self.request,
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
            self._finish(),
            None if self.finished_at is None else self.finished_at - created,
            None if self.admitted_at is None else self.admitted_at - created,
            None if self.first_token_at is None else self.first_token_at - created,
            self.answered,
            self.whole,
        )

    def _finish(self) -> str | None:
        """`RequestRecord.finish`."""
        if self.failed:
            return "error"
        reason = self.finish_reason
        if reason is None:
            return None
        kind: str | None = reason.get("type")
        return "tool_calls" if self.called_tools and kind == "stop" else kind

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from start to the terminal output, or None before `finish`."""
        if self.finished_at is None:
            return None
        return self.finished_at - self.created_at

    # -- the phases (docs/operations.md, "Request timing") --------------------------------

    @property
    def queue_time(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.created_at

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.created_at

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_at is None or self.admitted_at is None:
            return None
        return self.first_token_at - self.admitted_at

    @property
    def decode_time(self) -> float | None:
        if self.first_token_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.first_token_at

    @property
    def mean_inter_token_latency(self) -> float | None:
        decode = self.decode_time
        if decode is None or self.completion_tokens < 2:
            return None
        return decode / (self.completion_tokens - 1)

    @property
    def decode_throughput(self) -> float | None:
        """Tokens per second after the first one (null when there is no such interval)."""
        decode = self.decode_time
        if decode is None or self.completion_tokens < 2 or decode <= 0:
            return None
        return (self.completion_tokens - 1) / decode

    def detail(self) -> dict[str, Any]:
        """The `--enable-request-timing` keys of a terminal `meta_info`, in order; for a
        request that speculated, its drafted and accepted counts follow; behind a fleet,
        `worker_e2e_latency` (the worker's own e2e_latency) comes last."""
        detail: dict[str, Any] = {
            "time_to_first_token": self.time_to_first_token,
            "queue_time": self.queue_time,
            "prefill_time": self.prefill_time,
            "decode_time": self.decode_time,
            "mean_inter_token_latency": self.mean_inter_token_latency,
            "decode_throughput": self.decode_throughput,
        }
        spec = self.speculative
        if spec is not None:  # SGLang's meta_info names
            detail["spec_verify_ct"] = spec.verify_ct
            detail["spec_draft_token_num"] = spec.draft_tokens
            detail["spec_accept_token_num"] = spec.accepted_tokens
            detail["spec_accept_rate"] = (
                spec.accepted_tokens / spec.draft_tokens if spec.draft_tokens else None
            )
        if self.worker_e2e_latency is not None:
            detail["worker_e2e_latency"] = self.worker_e2e_latency
        return detail
