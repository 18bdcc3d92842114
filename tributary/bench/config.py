"""`BenchConfig`: what one benchmark run sends, and to which server.

Its own module so that the runner, which sends the requests, and the report, which names the
run's settings beside its figures, both read it without importing each other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

from .workload import WorkloadSpec

__all__ = ["BenchConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:30000"
    backend: Literal["generate", "openai"] = "generate"
    #: None: /generate, or /v1/completions for `openai` (/v1/chat/completions for chat).
    endpoint: str | None = None
    #: The `model` of OpenAI requests; None asks the server's /v1/models for its first.
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 64
    shared_prefix_len: int = 0
    seed: int = 1
    #: Build the prompts with this server's tokenizer instead of base_url's.
    tokenizer_from: str | None = None
    load_prompts: str | None = None
    save_prompts: str | None = None
    #: Requests in flight at most (None: no limit).
    concurrency: int | None = None
    #: Poisson arrivals per second (inf: all at once, or as workers free up).
    request_rate: float = math.inf
    warmup: int = 1
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: Seconds one request may take before it counts as failed (None: no limit).
    timeout: float | None = None
    #: The name this run goes by in plots (default: backend and base URL).
    label: str | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive, got {self.request_rate}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be at least 1, got {self.output_len}")
        WorkloadSpec(  # the same checks the workload makes, before any request is sent
            num_prompts=self.num_prompts,
            input_len=self.input_len,
            shared_prefix_len=self.shared_prefix_len,
            warmup=self.warmup,
        )
