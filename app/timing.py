"""`RequestTiming`: each request measures itself, on Trio's clock.

Synopsis::

    timing = RequestTiming.start(exchange)     # after normalization, before tokenization/submit
    item = timing.for_item(stream, request)    # one per engine request (batch items share start)
    ...                                        # for every engine item, the moment it arrives:
    item.observe(output)                       # first output, inter-token gaps, terminal
    meta_info["e2e_latency"] = item.e2e_latency

This is SGLang's boundary (the Rust server's `RequestTiming`, Python's `created_time` in
`_init_req_state`): the latency excludes HTTP parsing and body validation, and includes
tokenization, queueing, prefill, decode and detokenization up to the terminal output. Under
`autojump_clock` the numbers are exact virtual times. A batch shares one start instant
(`for_item`), while each item finishes on its own.

The engine stamps each `Done` with when the request was admitted to a running slot and when
its first token was sampled (same clock), so the phases below all share `e2e_latency`'s start
(docs/operations.md defines them). The same object feeds `/metrics` (`Metrics`, when the
exchange has one) and the access log, so a dashboard, a log line and a response never
disagree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from tributary.engine import Done, Error, FinishReason, GenerateRequest, Output, RequestStream

from .errors import abort_status

if TYPE_CHECKING:
    from .exchange import Exchange

__all__ = ["RequestTiming"]


class RequestTiming:
    def __init__(self, created_at: float, exchange: Exchange | None = None) -> None:
        self.created_at = created_at
        self.exchange = exchange
        self.first_output_at: float | None = None
        self.finished_at: float | None = None
        #: From the engine's `Done`.
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        #: What a remote worker measured for its part (None: served locally).
        self.worker_e2e_latency: float | None = None
        #: What the item was and how it ended (for metrics and the access log).
        self.rid: str | None = None
        self.request: GenerateRequest | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.failed = False  # ended with an `Error` item
        #: Count the request in /metrics when its answer arrives. A caller whose response
        #: may still fail after this item answered (a `/v1` choice: any choice's failure
        #: fails the whole response) sets it False and calls `count_answer` on success.
        self.count_on_done = True
        self._counted = False
        self._last_output_at = 0.0
        self._last_tokens = 0

    @classmethod
    def start(cls, exchange: Exchange | None = None) -> RequestTiming:
        return cls(trio.current_time(), exchange)

    def for_item(
        self,
        stream: RequestStream | None = None,
        request: GenerateRequest | None = None,
        *,
        count_on_done: bool = True,
    ) -> RequestTiming:
        """A fresh timing for one engine request, sharing this request's start instant; the
        exchange (if any) logs it when the HTTP exchange ends."""
        item = RequestTiming(self.created_at, self.exchange)
        item.count_on_done = count_on_done
        if stream is not None:
            item.rid = stream.rid
            item.prompt_tokens = stream.prompt_tokens
        item.request = request
        if self.exchange is not None:
            self.exchange.items.append(item)
        return item

    def observe(self, item: Output) -> None:
        """Record one engine item, the moment it arrives. The terminal one (`Done` or `Error`)
        ends the request; a `Done` that is an answer (not a failure) is counted in /metrics."""
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
            metrics = self.exchange.metrics if self.exchange is not None else None
            if metrics is not None:
                metrics.observe_inter_token_latency(
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
            if self.count_on_done and abort_status(item.finish_reason) is None:
                self.count_answer()

    def count_answer(self) -> None:
        """Count this request in /metrics as one that ended with an answer (its response
        carries `e2e_latency`)."""
        metrics = self.exchange.metrics if self.exchange is not None else None
        if metrics is not None and not self._counted:
            self._counted = True
            metrics.observe_finished(self)

    def finish(self) -> None:
        if self.finished_at is None:
            self.finished_at = trio.current_time()

    @property
    def time_to_first_output(self) -> float | None:
        """When the first output item reached the HTTP layer (for a stream, the first
        frame; with `stream_interval` > 1 that holds several tokens)."""
        if self.first_output_at is None:
            return None
        return self.first_output_at - self.created_at

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
        """The `--enable-request-timing` keys of a terminal `meta_info`, in order; behind a
        fleet, `worker_e2e_latency` (the worker's own e2e_latency) follows them."""
        detail: dict[str, Any] = {
            "time_to_first_token": self.time_to_first_token,
            "queue_time": self.queue_time,
            "prefill_time": self.prefill_time,
            "decode_time": self.decode_time,
            "mean_inter_token_latency": self.mean_inter_token_latency,
            "decode_throughput": self.decode_throughput,
        }
        if self.worker_e2e_latency is not None:
            detail["worker_e2e_latency"] = self.worker_e2e_latency
        return detail
