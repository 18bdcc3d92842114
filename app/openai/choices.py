"""Choices: one engine stream each, folded into what OpenAI's `choices[]` and `usage` report.

Synopsis::

    choices = await collect(streams)                 # unary: every choice to its end
    usage_object(choices, n=req.n)                   # prompt tokens counted once per prompt
    finish_fields(choices[0].finish_reason)          # {"finish_reason": ..., "matched_stop": ...}

`collect` drains every stream (`generation/generated.py: collect_into`); the result keeps
submission order (prompt-major: prompt 0's n choices, then prompt 1's, ...). The first failure
(an `Error` item, or an abort that carries a status code) cancels the other drains, which
aborts their requests, and is raised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tributary.engine import FinishReason, RequestStream

from ..generation.generated import Generated, collect_into
from ..observe.timing import RequestTiming

__all__ = ["Choice", "collect", "finish_fields", "usage_object"]


@dataclasses.dataclass
class Choice(Generated):
    #: The output was read into tool calls (its `finish_fields` say `tool_calls`).
    called: bool = False


def finish_fields(reason: FinishReason | None, *, called: bool = False) -> dict[str, Any]:
    """OpenAI's `finish_reason` (`stop`, `length`, `abort`) and SGLang's `matched_stop` (the
    stop string or token id that ended the choice, else null). A choice that made tool calls
    (`called`) and stopped finishes with `tool_calls` and no `matched_stop` (SGLang's rule: a
    call cut short by `length` stays `length`)."""
    if reason is None:
        return {"finish_reason": None, "matched_stop": None}
    kind = reason.get("type")
    if called and kind == "stop":
        return {"finish_reason": "tool_calls", "matched_stop": None}
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
    await collect_into(streams, choices, timings)
    return choices
