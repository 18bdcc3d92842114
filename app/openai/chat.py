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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quart import Response
from tributary.engine import Done, Frame

from ..generate import submit_all
from ..output import json_response
from .choices import Choice, collect, finish_fields, usage_object
from .protocol import ChatRequest, parse_chat
from .served import ServedModel
from .streaming import chunk_stream_response

__all__ = ["create_chat_completion", "render_chat_prompt"]


def render_chat_prompt(served: ServedModel, req: ChatRequest) -> list[int]:
    """The prompt tokens for `req.messages`: template text, no special tokens added."""
    text = served.chat_template().render(req.messages)
    return served.engine.tokenize(text, add_special=False)


async def create_chat_completion(served: ServedModel, body: Any, owned: list[Any]) -> Response:
    """Raises `engine.EngineError` (OpenAI-shaped by the blueprint) before the first byte."""
    engine = served.engine
    req = parse_chat(body, vocab_size=engine.model_info.vocab_size)
    served.check_model(req.model)
    served.check_max_tokens(req)
    prompt_ids = render_chat_prompt(served, req)
    streams = submit_all(engine, served.expand([prompt_ids], req))
    owned.extend(streams)
    head = served.response_head("chatcmpl", "chat.completion", req)
    if req.stream:
        return chunk_stream_response(streams, _Chunks(head, req))
    choices = await collect(streams)
    return json_response(
        {
            **head,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": choice.text},
                    "logprobs": None,
                    **finish_fields(choice.finish_reason),
                }
                for i, choice in enumerate(choices)
            ],
            "usage": usage_object(choices, n=req.n),
        }
    )


class _Chunks:
    def __init__(self, head: dict[str, Any], req: ChatRequest) -> None:
        self._head = {**head, "object": "chat.completion.chunk"}
        self._n = req.n
        self._include_usage = req.include_usage
        self._started: set[int] = set()

    def on_output(self, index: int, item: Frame | Done, choice: Choice) -> list[dict[str, Any]]:
        chunks = []
        if index not in self._started:
            self._started.add(index)
            chunks.append(self._chunk(index, {"role": "assistant", "content": ""}))
        if item.text:
            chunks.append(self._chunk(index, {"content": item.text}))
        if isinstance(item, Done):
            chunks.append(self._chunk(index, {}, finish_fields(choice.finish_reason)))
        return chunks

    def on_end(self, choices: Sequence[Choice]) -> list[dict[str, Any]]:
        if not self._include_usage:
            return []
        return [{**self._head, "choices": [], "usage": usage_object(choices, n=self._n)}]

    def _chunk(
        self, index: int, delta: dict[str, Any], finish: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": None,
            **(finish or {"finish_reason": None}),
        }
        chunk = {**self._head, "choices": [choice]}
        if self._include_usage:
            chunk["usage"] = None
        return chunk
