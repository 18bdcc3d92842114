"""`POST /v1/completions`: OpenAI's text completion over the engine.

Unary::

    {"id", "object": "text_completion", "created", "model",
     "choices": [{"index", "text", "logprobs": null, "finish_reason", "matched_stop"}, ...],
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens",
               "prompt_tokens_details": {"cached_tokens"}}}

Streaming: one `text_completion` chunk per delta (`choices` holds the one choice it is
about), the last one of each choice carrying `finish_reason`; with
`stream_options.include_usage`, every chunk has `"usage": null` and a last chunk with empty
`choices` carries the usage. Then `data: [DONE]`.

Choices are prompt-major: choice `i` is sample `i % n` of prompt `i // n`. `echo` prefixes
each choice's text with its prompt (token prompts are detokenized).

With `logprobs: N`, `choices[i].logprobs` is `{"text_offset", "token_logprobs", "tokens",
"top_logprobs"}` (logprobs.py), the prompt's entries first with `echo`; a stream's chunks each
carry the entries of their own tokens (the prompt's in a choice's first chunk), so a chunk may
have logprobs and empty text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quart import Response

from tributary.engine import Done, Frame
from tributary.engine.offload import detokenize_all

from ..generation import submit_owned
from ..http.responses import json_response
from ..http.view import ViewRequest
from ..observe.timing import RequestTiming
from .choices import Choice, collect, finish_fields, usage_object
from .logprobs import CompletionLogprobs, merge_completion_logprobs
from .protocol import CompletionRequest, parse_completion
from .served import ServedModel
from .streaming import chunk_stream_response
from .timings import llama_timings

__all__ = ["create_completion"]


async def create_completion(served: ServedModel, request: ViewRequest) -> Response:
    """n choices per prompt (the `ViewRequest` contract), answered whole or as chunks."""
    req = parse_completion(
        request.body,
        vocab_size=served.engine.model_info.vocab_size,
        max_logprobs=served.max_logprobs,
    )
    served.check_model(req.model)
    served.check_max_tokens(req)
    timing = RequestTiming.start(request.exchange, whole=True)  # any choice's failure fails it all
    items = served.expand(req.prompts, req)
    streams = await submit_owned(served.engine, items, request)
    # After submitting: a prompt too long for the context is refused before its ids are
    # read back (and a long list is read off the event loop).
    echoes = await _echoes(served, req) if req.echo else None
    timings = [timing.for_item(s, item) for s, item in zip(streams, items, strict=True)]
    head = served.response_head("cmpl", "text_completion", req)
    shapers = _logprob_shapers(served, req, echoes, len(streams))
    if req.stream:
        renderer = _Chunks(head, req, echoes, shapers)
        return chunk_stream_response(streams, renderer, timings, timing_detail=served.timing_detail)
    choices = await collect(streams, timings)
    return json_response(
        {
            **head,
            "choices": [
                {
                    "index": i,
                    "text": (echoes[i] if echoes else "") + choice.text,
                    "logprobs": (
                        merge_completion_logprobs([shapers[i].render(lp) for lp in choice.logprobs])
                        if shapers
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


async def _echoes(served: ServedModel, req: CompletionRequest) -> list[str]:
    """Each choice's prompt text, for `echo`: token prompts detokenized all in one go, in a
    worker thread when long (`offload.detokenize_all`)."""
    lists = [p for p in req.prompts if not isinstance(p, str)]
    decoded = iter(await detokenize_all(served.tokenizer, lists, skip_special_tokens=False))
    texts = [p if isinstance(p, str) else next(decoded) for p in req.prompts]
    return [text for text in texts for _ in range(req.n)]


def _logprob_shapers(
    served: ServedModel, req: CompletionRequest, echoes: list[str] | None, count: int
) -> list[CompletionLogprobs] | None:
    """One per choice when logprobs were asked for."""
    if req.logprobs is None:
        return None
    special = not req.sampling.skip_special_tokens
    return [
        CompletionLogprobs(served.speller, echo=echoes[i] if echoes else None, special=special)
        for i in range(count)
    ]


class _Chunks:
    def __init__(
        self,
        head: dict[str, Any],
        req: CompletionRequest,
        echoes: list[str] | None,
        shapers: list[CompletionLogprobs] | None,
    ) -> None:
        self._head = head
        self._n = req.n
        self.include_usage = req.include_usage
        self._pending_echo = dict(enumerate(echoes)) if echoes else {}
        self._shapers = shapers

    def on_output(self, index: int, item: Frame | Done, choice: Choice) -> list[dict[str, Any]]:
        text = self._pending_echo.pop(index, "") + item.text
        logprobs = None
        if self._shapers is not None and item.logprobs is not None:
            logprobs = self._shapers[index].render(item.logprobs)
        if isinstance(item, Frame):
            if not text and not (logprobs and logprobs["tokens"]):
                return []
            return [self._chunk(index, text, logprobs, {"finish_reason": None})]
        return [self._chunk(index, text, logprobs, finish_fields(choice.finish_reason))]

    def on_end(self, choices: Sequence[Choice]) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [{**self._head, "choices": [], "usage": usage_object(choices, n=self._n)}]

    def _chunk(
        self,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        finish: dict[str, Any],
    ) -> dict[str, Any]:
        chunk = {
            **self._head,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, **finish}],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk
