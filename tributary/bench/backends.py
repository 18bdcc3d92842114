"""One benchmark request: its body for each API, sent and read as a stream.

Two backends, each defined as `sglang.bench_serving` reads the same API:

- `generate`: SGLang's native `/generate` with `"stream": true` and
  `sampling_params.ignore_eos`.
- `openai`: `/v1/completions` or `/v1/chat/completions` with `stream_options.include_usage`
  and the `ignore_eos` body field (vLLM's, SGLang's and llama.cpp's server's extension).

The request is timed with `time.perf_counter()` from just before it is sent; its end-to-end
latency ends when the stream does, after `data: [DONE]`. What the stream tells is read by the
parsers of `streams.py`. A request fails (never dropped) on a non-200 status, a transport
error, `--timeout`, or whatever its stream parser refuses.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import httpx
import trio

from .streams import (
    GenerateStream,
    OpenAIStream,
    RequestRecord,
    StreamFailure,
    StreamParser,
    clip,
    http_error,
)
from .workload import Prompt

__all__ = ["Backend", "send_request"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backend:
    """How to ask one server for a completion of fixed length."""

    kind: Literal["generate", "openai"]
    base_url: str
    #: "/generate", "/v1/completions" or "/v1/chat/completions".
    endpoint: str
    output_len: int
    model: str | None = None
    #: Keep generating past EOS so every request yields output_len tokens.
    ignore_eos: bool = True
    temperature: float = 0.0
    #: Merged into every body (for `generate`, its sampling_params into sampling_params).
    extra_body: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    api_key: str | None = None

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: Prompt) -> dict[str, Any]:
        extra = dict(self.extra_body)
        if self.kind == "generate":
            sampling = {
                "max_new_tokens": self.output_len,
                "temperature": self.temperature,
                "ignore_eos": self.ignore_eos,
                **extra.pop("sampling_params", {}),
            }
            return {"text": prompt.text, "sampling_params": sampling, "stream": True, **extra}
        body: dict[str, Any] = {
            "max_tokens": self.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model is not None:
            body["model"] = self.model
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = prompt.text
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's, SGLang's and llama.cpp's server's extension
        return body | extra

    def parser(self, record: RequestRecord) -> StreamParser:
        if self.kind == "generate":
            return GenerateStream(record)
        return OpenAIStream(record, chat=self.chat)


#: Resends of a request whose kept-alive connection turned out closed before any reply.
MAX_RETRIES = 1


def _closed_before_reply(exc: httpx.RemoteProtocolError) -> bool:
    """httpx's words for a connection that ended before a response began."""
    return "without sending a response" in str(exc)


async def send_request(
    client: httpx.AsyncClient,
    backend: Backend,
    prompt: Prompt,
    record: RequestRecord,
    *,
    timeout: float | None = None,
) -> None:
    """Send one streaming request and fill `record`; never raises for a failed request
    (its reason goes to `record.error`). Cancellation propagates."""
    parser = backend.parser(record)
    deadline: AbstractContextManager[object] = (
        trio.fail_after(timeout) if timeout else nullcontext()
    )
    body = backend.body(prompt)
    try:
        with deadline:
            record.start = time.perf_counter()
            while True:
                try:
                    async with client.stream(
                        "POST", backend.url, json=body, headers=backend.headers
                    ) as response:
                        if response.status_code != 200:
                            reply = await response.aread()
                            raise StreamFailure(http_error(response.status_code, reply))
                        async for line in response.aiter_lines():
                            if line.startswith("data:"):
                                parser.on_data(line[5:].strip(), time.perf_counter())
                    break
                except httpx.RemoteProtocolError as exc:
                    # A kept-alive connection the server had closed (llama-server closes after
                    # every stream without saying so): the request never reached it. Send it
                    # again on a new connection, once, as browsers and urllib3 do.
                    if not _closed_before_reply(exc) or record.retries >= MAX_RETRIES:
                        raise
                    record.retries += 1
            record.e2e_latency = time.perf_counter() - record.start
        parser.finish()
        record.ok = True
    except StreamFailure as exc:
        record.error = clip(str(exc))
    except trio.TooSlowError:
        record.error = f"timed out after {timeout:g} s"
    except httpx.HTTPError as exc:
        record.error = clip(f"{type(exc).__name__}: {exc}".rstrip(": "))
    except (ValueError, TypeError, AttributeError) as exc:  # an event that is not the API's JSON
        record.error = clip(f"malformed event: {type(exc).__name__}: {exc}")
