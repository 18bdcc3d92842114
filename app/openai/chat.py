"""`POST /v1/chat/completions`: messages rendered with the model's own chat template.

The prompt is `ChatTemplate.render(messages)` (add_generation_prompt on), tokenized without
adding special tokens; a model without a template is a 400 (`NoChatTemplate`), never a guess.

Unary::

    {"id", "object": "chat.completion", "created", "model",
     "choices": [{"index", "message": {"role": "assistant", "content"}, "logprobs": null,
                  "finish_reason", "matched_stop"}, ...],
     "usage": {...}}                                   # as /v1/completions

Streaming (`chat.completion.chunk`), per choice: `delta: {"role": "assistant", "content": ""}`
with its first output, then `delta: {"content": ...}` for each non-empty delta, then
`delta: {}` with `finish_reason`; with `stream_options.include_usage`, `"usage": null` on
every chunk and a last chunk with empty `choices` and the usage. Then `data: [DONE]`.

With `logprobs: true`, `choices[i].logprobs` is `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}` (logprobs.py); in a stream each
content chunk carries the entries of its own tokens (so one may have logprobs and empty
content), the others `"logprobs": null`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from quart import Response

from tributary.engine import Done, Frame

from ..chat.template import render_prompt_ids
from ..generation import submit_all
from ..http.limits import Deadline
from ..http.responses import json_response
from ..observe.exchange import Exchange
from ..observe.timing import RequestTiming
from .choices import Choice, collect, finish_fields, usage_object
from .logprobs import TokenSpeller, chat_logprob_content
from .protocol import ChatRequest, parse_chat
from .relay import relay_to_worker
from .served import ServedModel
from .streaming import chunk_stream_response
from .timings import llama_timings

__all__ = ["create_chat_completion", "render_chat_prompt"]


async def render_chat_prompt(served: ServedModel, req: ChatRequest) -> list[int]:
    """The prompt tokens for `req.messages`: template text, no special tokens added.
    Rendered and tokenized off the event loop unless the chat is short (`render_prompt_ids`)."""
    return await render_prompt_ids(served.chat_template(), served.tokenizer, req.messages)


async def create_chat_completion(
    served: ServedModel,
    body: Any,
    owned: list[Any],
    exchange: Exchange | None = None,
    *,
    deadline: Deadline | None = None,
) -> Response:
    """Raises `engine.EngineError` (OpenAI-shaped by the blueprint) before the first byte;
    past `deadline`, a 408 (the status, or a stream's error event)."""
    engine = served.engine
    if served.passthrough is not None:  # the template and tokenizer are the workers'
        return await relay_to_worker(
            served,
            served.passthrough,
            "/v1/chat/completions",
            body,
            owned,
            exchange,
            deadline=deadline or Deadline(None, math.inf),
        )
    req = parse_chat(
        body, vocab_size=engine.model_info.vocab_size, max_logprobs=served.max_logprobs
    )
    served.check_model(req.model)
    served.check_max_tokens(req)
    timing = RequestTiming.start(exchange, whole=True)  # any choice's failure fails it all
    prompt_ids = await render_chat_prompt(served, req)
    items = served.expand([prompt_ids], req)
    streams = await submit_all(engine, items, deadline)
    owned.extend(streams)
    timings = [timing.for_item(s, item) for s, item in zip(streams, items, strict=True)]
    head = served.response_head("chatcmpl", "chat.completion", req)
    if req.stream:
        renderer = _Chunks(head, req, served.speller)
        return chunk_stream_response(streams, renderer, timings, timing_detail=served.timing_detail)
    choices = await collect(streams, timings)
    return json_response(
        {
            **head,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": choice.text},
                    "logprobs": (
                        {
                            "content": [
                                entry
                                for lp in choice.logprobs
                                for entry in chat_logprob_content(served.speller, lp)
                            ]
                        }
                        if req.logprobs is not None
                        else None
                    ),
                    **finish_fields(choice.finish_reason),
                }
                for i, choice in enumerate(choices)
            ],
            "usage": usage_object(choices, n=req.n),
            **({"timings": llama_timings(timings)} if served.timing_detail else {}),
        }
    )


class _Chunks:
    def __init__(self, head: dict[str, Any], req: ChatRequest, speller: TokenSpeller) -> None:
        self._head = {**head, "object": "chat.completion.chunk"}
        self._n = req.n
        self.include_usage = req.include_usage
        self._speller = speller if req.logprobs is not None else None
        self._started: set[int] = set()

    def on_output(self, index: int, item: Frame | Done, choice: Choice) -> list[dict[str, Any]]:
        chunks = []
        if index not in self._started:
            self._started.add(index)
            chunks.append(self._chunk(index, {"role": "assistant", "content": ""}))
        content = None
        if self._speller is not None and item.logprobs is not None:
            content = chat_logprob_content(self._speller, item.logprobs)
        if item.text or content:
            logprobs = None if content is None else {"content": content}
            chunks.append(self._chunk(index, {"content": item.text}, logprobs=logprobs))
        if isinstance(item, Done):
            chunks.append(self._chunk(index, {}, finish_fields(choice.finish_reason)))
        return chunks

    def on_end(self, choices: Sequence[Choice]) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [{**self._head, "choices": [], "usage": usage_object(choices, n=self._n)}]

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any],
        finish: dict[str, Any] | None = None,
        *,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            **(finish or {"finish_reason": None}),
        }
        chunk = {**self._head, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk
