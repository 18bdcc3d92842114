"""`RequestTiming`: each request measures itself, on Trio's clock.

Synopsis::

    timing = RequestTiming.start()         # after normalization, before tokenization/submit
    ...                                    # submit, then for each engine item:
    timing.observe_first_output()          # on the first Frame or Done; later calls are no-ops
    timing.finish()                        # on Done or Error; later calls are no-ops
    meta_info["e2e_latency"] = timing.e2e_latency

This is SGLang's boundary (the Rust server's `RequestTiming`, Python's `created_time` in
`_init_req_state`): the latency excludes HTTP parsing and body validation, and includes
tokenization, queueing, prefill, decode and detokenization up to the terminal output. Under
`autojump_clock` the numbers are exact virtual times. A batch shares one start instant
(`for_item`), while each item finishes on its own.
"""

from __future__ import annotations

import trio

__all__ = ["RequestTiming"]


class RequestTiming:
    def __init__(self, created_at: float) -> None:
        self.created_at = created_at
        self.first_output_at: float | None = None
        self.finished_at: float | None = None

    @classmethod
    def start(cls) -> RequestTiming:
        return cls(trio.current_time())

    def for_item(self) -> RequestTiming:
        """A fresh timing for one batch item, sharing this request's start instant."""
        return RequestTiming(self.created_at)

    def observe_first_output(self) -> None:
        if self.first_output_at is None:
            self.first_output_at = trio.current_time()

    def finish(self) -> None:
        if self.finished_at is None:
            self.finished_at = trio.current_time()

    @property
    def time_to_first_output(self) -> float | None:
        """Recorded for metrics; deliberately not exposed in responses (as SGLang)."""
        if self.first_output_at is None:
            return None
        return self.first_output_at - self.created_at

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from start to the terminal output, or None before `finish`."""
        if self.finished_at is None:
            return None
        return self.finished_at - self.created_at
