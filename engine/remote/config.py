"""`RemoteConfig`: the settings of a front serving from workers (`tributary serve
--worker-url ...`), and the constants of its exchanges with them.

Synopsis::

    config = RemoteConfig(workers=(("http://10.0.0.5:30000", "sglang"),), max_retries=2)
    async with open_remote_engine(config) as eng: ...
"""

from __future__ import annotations

import dataclasses

from .worker import WorkerKind

__all__ = ["CODE_FIELDS", "KEEPALIVE_SECONDS", "NO_CUSTOM_LOGIT_PROCESSOR", "RemoteConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    """A front serving from workers (`tributary serve --worker-url ...`)."""

    workers: tuple[tuple[str, WorkerKind], ...] = ()
    policy: str = "cache_aware"
    served_model_name: str | None = None
    #: Attempts after the first, for failures before the first output.
    max_retries: int = 3
    #: Backoff before retry k (1-based): retry_backoff * 2**(k-1), at most retry_backoff_max.
    retry_backoff: float = 0.05
    retry_backoff_max: float = 1.0
    #: Seconds between health probes of every worker (0: none).
    health_check_interval: float = 5.0
    health_check_timeout: float = 2.0
    connect_timeout: float = 5.0
    #: The longest a worker may stay silent once it has a request (`--worker-timeout`): for
    #: its answer's headers (a unary answer comes whole, once generated), then between two
    #: chunks of its body. Past it the item ends with a 504, not retried elsewhere.
    worker_timeout: float = 600.0
    #: How long a worker may take to name its model (an OpenAI worker's `/v1/models`, asked
    #: before its first request); past it the request is retried on another worker.
    info_timeout: float = 5.0
    #: The largest answer the front holds whole (`--max-worker-answer-bytes`): a unary
    #: answer it relays (chat completions). Past it: a 502, not retried.
    max_answer_bytes: int = 64 << 20
    #: The largest single event of a worker's stream the front reads (`/generate`,
    #: `/v1/completions`): SGLang's cumulative frames hold the whole text so far. Past it: a
    #: 502, not retried.
    max_event_bytes: int = 16 << 20
    #: The most of a worker's error answer the front reads; the rest is cut (the status
    #: still decides: a 503 is retried elsewhere, a 400 is the client's).
    max_error_bytes: int = 1 << 20
    #: Forward `custom_logit_processor` (`/generate`, `/v1/completions`, chat relays) to the
    #: workers (`--enable-custom-logit-processor` at the front). Off, it is refused with a
    #: 501: a worker started with that flag runs the Python code a client sends.
    enable_custom_logit_processor: bool = False
    #: How long the `/abort_request` a cancelled item sends its worker may take.
    abort_timeout: float = 2.0
    #: A worker's breaker opens after this many failures in a row, for this many seconds
    #: (then one request tries it: half-open).
    breaker_failure_threshold: int = 3
    breaker_open_seconds: float = 5.0
    #: The most items in flight at the front (its `capacity`).
    max_in_flight: int = 4096
    runner: str = "remote"  # what /get_server_info shows


#: Seconds an idle keep-alive connection to a worker is kept. Below the 5 s that uvicorn
#: (SGLang, vLLM), Hypercorn (Tributary) and llama.cpp's server keep one: the front drops
#: an idle connection before the worker would, so a request is never sent on a connection
#: the worker is closing at that moment (which would read as the worker dropping it).
KEEPALIVE_SECONDS = 4.0

#: Request fields that make a worker run code the client sent: SGLang's custom logit
#: processor (a pickled callable), vLLM's logits processors (classes by qualified name).
CODE_FIELDS = ("custom_logit_processor", "logits_processors")

NO_CUSTOM_LOGIT_PROCESSOR = (
    "This server does not forward custom logit processors to its workers (a worker that "
    "takes them runs Python code the client sends). Start the front with "
    "--enable-custom-logit-processor to forward them, or send the request to a worker."
)
