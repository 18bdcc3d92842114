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

Tools and reasoning (`req.output`, app/chat/tools.py): the template gets `tools=` and the
request's `chat_template_kwargs`; the output is read for calls and reasoning, the message
carries `tool_calls` (content null when there is none) and, with `--reasoning-parser`,
`reasoning_content`; `finish_reason` is `tool_calls` when a call was made and the choice
stopped (SGLang's rule). Streams send `reasoning_content` deltas and OpenAI's `tool_calls`
deltas (tools.py: `call_delta_objects`). A request with neither is the plain path above,
untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quart import Response

from tributary.engine import Done, Frame

from ..chat.tools import OutputDelta, OutputSetup, OutputStream
from ..generation import submit_owned
from ..http.responses import json_response
from ..http.view import ViewRequest
from ..observe.timing import RequestTiming
from .choices import Choice, collect, finish_fields, usage_object
from .logprobs import TokenSpeller, chat_logprob_content
from .protocol import ChatRequest, parse_chat
from .relay import relay_to_worker
from .served import ServedModel
from .streaming import chunk_stream_response
from .timings import llama_timings
from .tools import call_delta_objects, message_fields

__all__ = ["create_chat_completion"]


async def create_chat_completion(served: ServedModel, request: ViewRequest) -> Response:
    """The chat's n choices (the `ViewRequest` contract), answered whole or as chunks; at a
    front, the body relayed to a worker whole."""
    if served.passthrough is not None:  # the template and tokenizer are the workers'
        return await relay_to_worker(
            served,
            served.passthrough,
            "/v1/chat/completions",
            request.body,
            request.owned,
            request.exchange,
            deadline=request.deadline,
        )
    req = parse_chat(
        request.body,
        vocab_size=served.engine.model_info.vocab_size,
        max_logprobs=served.max_logprobs,
        tool_call_parser=served.tool_call_parser,
        reasoning_parser=served.reasoning_parser,
    )
    served.check_model(req.model)
    served.check_max_tokens(req)
    timing = RequestTiming.start(request.exchange, whole=True)  # any choice's failure fails it all
    prompt_ids = await served.render_chat(req.messages, tools=req.tools, extra=req.template_extra)
    items = served.expand([prompt_ids], req)
    streams = await submit_owned(
        served.engine, items, request, tools=req.tools, schemas="parameters"
    )
    timings = [timing.for_item(s, item) for s, item in zip(streams, items, strict=True)]
    head = served.response_head("chatcmpl", "chat.completion", req)
    if req.stream:
        renderer = (
            _Chunks(head, req, served.speller)
            if req.output is None
            else _ParsedChunks(head, req, served.speller, req.output)
        )
        return chunk_stream_response(streams, renderer, timings, timing_detail=served.timing_detail)
    choices = await collect(streams, timings)
    messages = [_message(req.output, choice) for choice in choices]
    for choice, item_timing in zip(choices, timings, strict=True):
        item_timing.called_tools = choice.called
    return json_response(
        {
            **head,
            "choices": [
                {
                    "index": i,
                    **messages[i],
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
                    **finish_fields(choice.finish_reason, called=choice.called),
                }
                for i, choice in enumerate(choices)
            ],
            "usage": usage_object(choices, n=req.n),
            **({"timings": llama_timings(timings)} if served.timing_detail else {}),
        }
    )


def _message(output: OutputSetup | None, choice: Choice) -> dict[str, Any]:
    """The `message` of a unary choice; with tools or reasoning, read from its text (and
    `choice.called` set for `finish_fields`)."""
    if output is None:
        return {"message": {"role": "assistant", "content": choice.text}}
    read = output.split(choice.text)
    choice.called = bool(read.calls)
    fields = message_fields(read, reasoning=output.reasoning is not None)
    return {"message": {"role": "assistant", **fields}}


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


class _ParsedChunks(_Chunks):
    """`_Chunks` for output read for calls or reasoning: each item's text goes through the
    choice's `OutputStream` (held-back marker text comes out later, or at the end)."""

    def __init__(
        self,
        head: dict[str, Any],
        req: ChatRequest,
        speller: TokenSpeller,
        output: OutputSetup,
    ) -> None:
        super().__init__(head, req, speller)
        self._output = output
        self._streams: dict[int, OutputStream] = {}

    def on_output(self, index: int, item: Frame | Done, choice: Choice) -> list[dict[str, Any]]:
        chunks = []
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self._output.stream()
            chunks.append(self._chunk(index, {"role": "assistant", "content": ""}))
        deltas = [stream.feed(item.text)] if item.text else []
        if isinstance(item, Done):
            deltas.append(stream.finish())
        parts = [delta for read in deltas for delta in _delta_objects(read)]
        logprobs = None
        if self._speller is not None and item.logprobs is not None:
            logprobs = {"content": chat_logprob_content(self._speller, item.logprobs)}
            if not parts:
                parts.append({})
        for i, delta in enumerate(parts):
            chunks.append(self._chunk(index, delta, logprobs=logprobs if i == 0 else None))
        if isinstance(item, Done):
            choice.called = stream.called
            chunks.append(
                self._chunk(index, {}, finish_fields(choice.finish_reason, called=stream.called))
            )
        return chunks


def _delta_objects(read: OutputDelta) -> list[dict[str, Any]]:
    """One `delta` per piece, in the order the output had them: reasoning, content, calls."""
    out: list[dict[str, Any]] = []
    if read.reasoning:
        out.append({"reasoning_content": read.reasoning})
    if read.content:
        out.append({"content": read.content})
    out.extend({"tool_calls": [entry]} for entry in call_delta_objects(read.calls))
    return out
