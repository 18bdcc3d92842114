"""Choices: one engine stream each, folded into what OpenAI's `choices[]` and `usage` report.

Synopsis::

    choices = await collect(streams)                 # unary: every choice to its end
    usage_object(choices, n=req.n)                   # prompt tokens counted once per prompt
    finish_fields(choices[0].finish_reason)          # {"finish_reason": ..., "matched_stop": ...}

`collect` drains every stream concurrently in one nursery; the result keeps submission order
(prompt-major: prompt 0's n choices, then prompt 1's, ...). The first failure (an `Error`
item, or an abort that carries a status code) cancels the other drains, which aborts their
requests, and is raised. A caller that is cancelled (client gone) leaves every stream's
`async with`, which aborts each request synchronously.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import trio

from tributary.engine import (
    Done,
    EngineError,
    Error,
    FinishReason,
    Logprobs,
    Output,
    RequestStream,
    collect_redirected,
)

from ..http.errors import StatusError, abort_status
from ..observe.timing import RequestTiming

__all__ = ["Choice", "collect", "finish_fields", "usage_object"]


@dataclasses.dataclass
class Choice:
    prompt_tokens: int
    text: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    #: The logprobs each item carried, in order (empty when none were asked for).
    logprobs: list[Logprobs] = dataclasses.field(default_factory=list)

    def add(self, item: Output) -> EngineError | None:
        """Fold one engine item in; return the failure it reports, if any."""
        if isinstance(item, Error):
            return item.error
        self.text += item.text
        self.prompt_tokens = item.prompt_tokens
        self.completion_tokens = item.completion_tokens
        self.cached_tokens = item.cached_tokens
        if item.logprobs is not None:
            self.logprobs.append(item.logprobs)
        if isinstance(item, Done):
            self.finish_reason = item.finish_reason
            aborted = abort_status(item.finish_reason)
            if aborted is not None:
                return StatusError(*aborted)
        return None


def finish_fields(reason: FinishReason | None) -> dict[str, Any]:
    """OpenAI's `finish_reason` (`stop`, `length`, `abort`) and SGLang's `matched_stop` (the
    stop string or token id that ended the choice, else null)."""
    if reason is None:
        return {"finish_reason": None, "matched_stop": None}
    kind = reason.get("type")
    matched = reason.get("matched") if kind == "stop" else None
    return {"finish_reason": kind, "matched_stop": matched}


def usage_object(choices: Sequence[Choice], *, n: int) -> dict[str, Any]:
    """Usage as OpenAI and vLLM count it: each prompt's tokens (and cached tokens) once, every
    choice's completion tokens. A prompt's cached tokens are its first choice's (SGLang's
    count): the other choices fork that one's KV, and counting their copy as cached would
    report a prompt computed once as served from the cache."""
    prompts = [choices[i : i + n] for i in range(0, len(choices), n)]
    prompt_tokens = sum(group[0].prompt_tokens for group in prompts)
    cached = sum(group[0].cached_tokens for group in prompts)
    completion_tokens = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def collect(
    streams: Sequence[RequestStream], timings: Sequence[RequestTiming] | None = None
) -> list[Choice]:
    """`timings[i]`, when given, observes choice i's items as they arrive (their exchange
    counts them in /metrics only if every one answered: a failure fails the whole response)."""
    choices = [Choice(prompt_tokens=s.prompt_tokens) for s in streams]
    failures: list[EngineError | None] = [None] * len(streams)

    async def drain(i: int, cancel_scope: trio.CancelScope) -> None:
        timing = timings[i] if timings is not None else None

        def take(_index: int, item: Output) -> bool:  # in the scheduler, at delivery
            if timing is not None:
                timing.observe(item)
            failures[i] = choices[i].add(item)
            return failures[i] is not None

        async with streams[i]:  # closing aborts it unless it has ended
            await collect_redirected([streams[i]], take)
        if failures[i] is not None:
            cancel_scope.cancel()  # one choice's failure fails the response: stop the others

    async with trio.open_nursery() as nursery:
        for i in range(len(streams)):
            nursery.start_soon(drain, i, nursery.cancel_scope)
    for failure in failures:
        if failure is not None:
            raise failure
    return choices
