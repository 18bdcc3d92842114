"""What a benchmark request's SSE stream tells: times, tokens, text, or why it failed.

- `GenerateStream` reads SGLang's `/generate` frames, cumulative (SGLang's default) or
  incremental (`--incremental-streaming-output`): `meta_info.completion_tokens` is cumulative
  either way, so it counts the tokens, and the terminal frame carries the server's own
  `meta_info.e2e_latency`.
- `OpenAIStream` reads completion or chat completion chunks. Output tokens come from the usage
  chunk; without one, from llama.cpp's server's `timings`; without those, one per content chunk.

Timing: the time to first token is the arrival of the first chunk that carries output text;
each later content chunk adds its gap to the inter-token latencies, split evenly over the
chunk's new tokens when the frame says how many (as bench_serving does for `/generate`).

A stream fails (`StreamFailure`, its message the reason shown in the report) on an
`{"error": ...}` event, an abort finish reason, an early end, or no output text at all.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Protocol

__all__ = [
    "GenerateStream",
    "OpenAIStream",
    "RequestRecord",
    "StreamFailure",
    "StreamParser",
    "clip",
    "http_error",
]

#: Longest failure reason kept (a server's error body can be a whole page).
MAX_REASON = 300


@dataclasses.dataclass(kw_only=True)
class RequestRecord:
    """What the client saw of one request. Times are in seconds."""

    index: int
    #: The prompt's length as built; replaced by the server's count when it reports one.
    prompt_tokens: int
    #: perf_counter() when the request was sent.
    start: float = 0.0
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e_latency: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    #: Where output_tokens came from: meta_info, usage, timings or chunks.
    output_tokens_source: str | None = None
    #: The server's `meta_info.e2e_latency` (generate backend only).
    server_e2e_latency: float | None = None
    text: str = ""
    #: Times it was sent again because its kept-alive connection had been closed unannounced.
    retries: int = 0


class StreamFailure(Exception):
    """The request failed; `str(exc)` is the reason shown in the report."""


class StreamParser(Protocol):
    def on_data(self, payload: str, now: float) -> None: ...
    def finish(self) -> None: ...


class GenerateStream:
    """SGLang's `/generate` frames, cumulative or incremental."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.tokens = 0  # completion_tokens of the previous frame
        self.counted = 0  # completion_tokens at the previous content frame
        self.last = 0.0
        self.finished = False

    def on_data(self, payload: str, now: float) -> None:
        if payload == "[DONE]":
            return
        data = json.loads(payload)
        if "error" in data:
            raise StreamFailure(f"error event: {_message(data['error'])}")
        meta = data.get("meta_info") or {}
        piece = data.get("text") or ""
        tokens = meta.get("completion_tokens")
        if tokens is None:  # not SGLang's shape; count what is visible
            tokens = self.tokens + (1 if piece else 0)
        record = self.record
        if self._cumulative(piece, data.get("output_ids"), tokens):
            record.text = piece
        else:
            record.text += piece
        self.tokens = tokens
        new_tokens = tokens - self.counted
        if new_tokens > 0 and record.text:
            if record.ttft is None:
                record.ttft = now - record.start
            else:
                gap = (now - self.last) / new_tokens
                record.itl.extend([gap] * new_tokens)
            self.last, self.counted = now, tokens
        finish_reason = meta.get("finish_reason")
        if finish_reason is not None:
            self.finished = True
            if isinstance(finish_reason, dict) and finish_reason.get("type") == "abort":
                status = finish_reason.get("status_code")
                raise StreamFailure(
                    f"abort: {finish_reason.get('message')}" + (f" ({status})" if status else "")
                )
            record.output_tokens = tokens
            record.output_tokens_source = "meta_info"
            if isinstance(meta.get("prompt_tokens"), int):
                record.prompt_tokens = meta["prompt_tokens"]
            if isinstance(meta.get("e2e_latency"), int | float):
                record.server_e2e_latency = float(meta["e2e_latency"])

    def _cumulative(self, piece: str, output_ids: object, tokens: int) -> bool:
        if self.tokens == 0:
            return True  # the first frame reads the same either way
        if isinstance(output_ids, list):  # cumulative frames carry every id so far
            return len(output_ids) == tokens
        return piece.startswith(self.record.text)

    def finish(self) -> None:
        if not self.finished:
            raise StreamFailure("the stream ended before its terminal frame")
        if self.record.ttft is None:
            raise StreamFailure("no output text was received")


class OpenAIStream:
    """OpenAI's completion or chat completion chunks."""

    def __init__(self, record: RequestRecord, *, chat: bool) -> None:
        self.record = record
        self.chat = chat
        self.chunks = 0
        self.last = 0.0
        self.done = False
        self.finish_reason: str | None = None
        self.usage_tokens: int | None = None
        self.timings_tokens: int | None = None

    def on_data(self, payload: str, now: float) -> None:
        if payload == "[DONE]":
            self.done = True
            return
        data = json.loads(payload)
        if "error" in data:
            raise StreamFailure(f"error event: {_message(data['error'])}")
        record = self.record
        usage = data.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.usage_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                record.prompt_tokens = usage["prompt_tokens"]
        timings = data.get("timings")  # llama.cpp's server
        if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
            self.timings_tokens = timings["predicted_n"]
        for choice in data.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if piece:
                if record.ttft is None:
                    record.ttft = now - record.start
                else:
                    record.itl.append(now - self.last)
                self.last = now
                self.chunks += 1
                record.text += piece
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def finish(self) -> None:
        record = self.record
        if not self.done and self.finish_reason is None:
            raise StreamFailure("the stream ended before its last chunk")
        if self.finish_reason == "abort":
            raise StreamFailure('the server aborted the request (finish_reason "abort")')
        if record.ttft is None:
            raise StreamFailure("no output text was received")
        if self.usage_tokens is not None:
            record.output_tokens, record.output_tokens_source = self.usage_tokens, "usage"
        elif self.timings_tokens is not None:
            record.output_tokens, record.output_tokens_source = self.timings_tokens, "timings"
        else:
            record.output_tokens, record.output_tokens_source = self.chunks, "chunks"


def http_error(status: int, body: bytes) -> str:
    """`HTTP 400: <the server's message>` from any of the error shapes in use."""
    try:
        answer = json.loads(body)
    except ValueError:
        return f"HTTP {status}: {body.decode(errors='replace').strip()}"
    if isinstance(answer, dict):
        for key in ("error", "message", "detail"):
            if key in answer:
                return f"HTTP {status}: {_message(answer[key])}"
    return f"HTTP {status}: {json.dumps(answer)}"


def _message(error: object) -> str:
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return error if isinstance(error, str) else json.dumps(error)


def clip(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 3] + "..."
