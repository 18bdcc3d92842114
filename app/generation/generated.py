"""`Generated`: one engine stream folded into what every API reports of it (text, token
counts, finish reason, logprobs), and `collect_into`, which drains streams into them.

Synopsis::

    out = Generated(prompt_tokens=stream.prompt_tokens)
    failure = out.add(item)                          # each engine item, at delivery
    await collect_into(streams, outs, timings)       # unary: every stream to its end

Each API subclasses it with its own reading of the result (`openai/choices.py: Choice`,
`anthropic/reply.py: Reply`). `add` runs in the scheduler for every item, so it stays one
call: a subclass adds fields and methods, not a layer around it.

`collect_into` drains every stream concurrently in one nursery. The first failure (an `Error`
item, or an abort that carries a status code, or what `aborted` makes of one that does not)
cancels the other drains, which aborts their requests, and is raised. A caller that is
cancelled (client gone) leaves every stream's `async with`, which aborts each request
synchronously.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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

__all__ = ["Generated", "collect_into"]


@dataclasses.dataclass
class Generated:
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
            if item.finish_reason.get("type") == "abort":
                return self.aborted(item.finish_reason)
        return None

    def aborted(self, reason: FinishReason) -> EngineError | None:
        """The failure an abort without a status code (`/abort_request`) is in this API; by
        default none: the output ends with finish reason `abort`."""
        return None


async def collect_into(
    streams: Sequence[RequestStream],
    outputs: Sequence[Generated],
    timings: Sequence[RequestTiming] | None = None,
) -> None:
    """Fold each of `streams` into its `outputs[i]`, each item at delivery; raise the first
    failure. `timings[i]`, when given, observes stream i's items as they arrive."""
    failures: list[EngineError | None] = [None] * len(streams)

    async def drain(i: int, cancel_scope: trio.CancelScope) -> None:
        timing = timings[i] if timings is not None else None
        output = outputs[i]

        def take(_index: int, item: Output) -> bool:  # in the scheduler, at delivery
            if timing is not None:
                timing.observe(item)
            failures[i] = output.add(item)
            return failures[i] is not None

        async with streams[i]:  # closing aborts it unless it has ended
            await collect_redirected([streams[i]], take)
        if failures[i] is not None:
            cancel_scope.cancel()  # one stream's failure fails the response: stop the others

    async with trio.open_nursery() as nursery:
        for i in range(len(streams)):
            nursery.start_soon(drain, i, nursery.cancel_scope)
    for failure in failures:
        if failure is not None:
            raise failure
