"""`ServerSettings`: how the HTTP front end listens and shapes responses.

Engine settings (model, context length, batch sizes, stream interval) live in
`engine.EngineConfig`; these are only the HTTP side. Every field has a `tributary serve` flag or
a documented default (docs/operations.md).
"""

from __future__ import annotations

import dataclasses
import math

from .chat.reasoning import REASONING_PARSER_NAMES
from .chat.tool_parsers import TOOL_PARSER_NAMES

__all__ = ["ServerSettings"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerSettings:
    host: str = "127.0.0.1"
    #: 0 picks a free port; `open_http_server` yields the URL actually bound.
    port: int = 30000
    #: Stream deltas instead of the cumulative text (SGLang's --incremental-streaming-output).
    #: Counts (`completion_tokens`, ...) stay cumulative either way.
    incremental_streaming_output: bool = False
    #: Echoed as `meta_info.weight_version` (SGLang's --weight-version).
    weight_version: str = "default"
    #: Seconds in-flight requests get to finish after a graceful shutdown begins; streams
    #: still open at the deadline are cut.
    graceful_timeout: float = 5.0
    #: Seconds an idle keep-alive connection stays open.
    keep_alive_timeout: float = 5.0
    #: TCP_USER_TIMEOUT on accepted sockets, in seconds: a peer that stops reading (zero
    #: window) is dropped after this long instead of pinning a shielded send, and shutdown.
    tcp_user_timeout: float = 30.0
    #: `/health_generate` answers 503 if its one-token probe takes longer than this.
    health_check_timeout: float = 20.0
    #: When set, every request except `/health*` must send `Authorization: Bearer <key>`
    #: (SGLang's --api-key); others get 401.
    api_key: str | None = None
    #: When set, the routes that change server state (`admin.ADMIN_PATHS`: `/abort_request`,
    #: `/flush_cache`) need `Authorization: Bearer <admin key>`; `api_key` no longer opens
    #: them. The admin key also opens every route `api_key` guards.
    admin_api_key: str | None = None
    #: Seconds a request may take, reading its body to its last output (`--request-timeout`);
    #: past it, what still generates is aborted and the client gets a 408. A request's
    #: `X-Request-Timeout` header may shorten it. None: no server-wide deadline.
    request_timeout: float | None = None
    #: The largest request body accepted, in bytes (`--max-request-bytes`); a larger one gets
    #: a 413, refused before it is read (Content-Length) or as soon as it passes the limit
    #: (chunked).
    max_request_bytes: int = 4 * 1024 * 1024
    #: The most alternatives per position a request may ask for (`--max-logprobs`, vLLM's
    #: flag and default): `/generate`'s `top_logprobs_num`, `/v1`'s `logprobs` and
    #: `top_logprobs` (those also within OpenAI's 20). More is a 400.
    max_logprobs: int = 20
    #: Logged by `tributary serve`; the library never configures logging itself.
    log_level: str = "info"
    #: `tributary serve`'s log lines: "text", or "json" (one JSON object per line).
    log_format: str = "text"
    #: Put each request's prompt (text or token ids) in its access log line.
    log_requests: bool = False
    #: Serve `GET /metrics` (Prometheus) and collect its numbers (`--disable-metrics`: off).
    enable_metrics: bool = True
    #: Terminal `meta_info` (and `/v1` responses' `timings`) carry the request's phases:
    #: time to first token, queue, prefill and decode time (docs/operations.md). Off by
    #: default, so responses stay byte-compatible with SGLang's.
    enable_request_timing: bool = False
    #: `--tool-call-parser`: the format (SGLang's names, `tool_parsers.TOOL_PARSER_NAMES`) in
    #: which `tool_choice: auto` output is read for tool calls. None: such output is content.
    tool_call_parser: str | None = None
    #: `--reasoning-parser`: the format (`reasoning.REASONING_PARSER_NAMES`) whose thinking
    #: chat responses carry as `reasoning_content`. None: thinking stays in the content.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        timeout = self.request_timeout
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"request_timeout must be a positive number of seconds, got {timeout}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be at least 1, got {self.max_request_bytes}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be at least 0, got {self.max_logprobs}")
        for name, known in (
            (self.tool_call_parser, TOOL_PARSER_NAMES),
            (self.reasoning_parser, REASONING_PARSER_NAMES),
        ):
            if name is not None and name not in known:
                raise ValueError(f"unknown parser {name!r}: expected one of {', '.join(known)}")

    @property
    def bind(self) -> str:
        """Hypercorn's bind string; IPv6 literals get brackets."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"
