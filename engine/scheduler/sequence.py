"""`Sequence`: one request inside the engine, from submit to its terminal output.

The engine builds it at submit and hands it to the scheduler (`Scheduler.enqueue`), whose
task alone changes it (an abort is a mark, `Scheduler.mark_abort`) and sends its outputs
(`emit_frame`, `emit_done`, `emit_error`) through its `OutputSender`. Whether a sampled
token ends it is `check_finished`: SGLang's stop rules, in SGLang's order.
"""

from __future__ import annotations

from ..detokenize import IncrementalDetokenizer
from ..errors import EngineError
from ..logits import LogitHooks
from ..prefix_cache import PrefixHit
from ..request import (
    Done,
    Error,
    FinishReason,
    Frame,
    Logprobs,
    Output,
    length_reason,
    stop_reason,
)
from ..sampling import SamplingParams
from ..speculative import SeqSpeculation
from ..stream import OutputSender

__all__ = ["Sequence"]


class Sequence:
    """One request inside the engine, from submit to its terminal output."""

    def __init__(
        self,
        *,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        stream_interval: int,
        detokenizer: IncrementalDetokenizer,
        sender: OutputSender,
        hooks: LogitHooks | None = None,
        stream: bool = True,
    ) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_new_tokens = max_new_tokens  # already clamped to the context
        self.stream_interval = stream_interval
        #: Someone reads the frames as they come (`GenerateRequest.stream`); a run then
        #: hands each decode's tokens over at once. Stop strings and regexes need the same:
        #: the text is searched after every token.
        self.watched = stream or bool(params.stop or params.stop_regex_patterns)
        self.detok = detokenizer
        self.sender = sender
        self.hooks = hooks
        self.slot: int | None = None
        self.prefilled = 0  # prompt tokens in the KV cache
        #: Prompt tokens whose KV came from the prefix cache or a fork, not computed.
        self.cached_tokens = 0
        #: A prefix cache hit to restore with the first chunk (its entry pinned till then).
        self.pending_restore: PrefixHit | None = None
        #: The sequence with the same prompt whose prefill this one waits to fork, and the
        #: sequences waiting to fork this one's.
        self.leader: Sequence | None = None
        #: The members of this request's burst (requests admitted with it) whose first token
        #: is still to come, shared by them all: its decodes are held while it is not empty.
        self.burst: set[Sequence] | None = None
        self.forks: list[Sequence] = []
        #: Its speculative decoding (set at admission); None: it never drafts.
        self.spec: SeqSpeculation | None = None
        self.output_ids: list[int] = []
        self.emitted_ids = 0  # output_ids already sent in a Frame
        #: Set by Engine.abort; acted on at the next step boundary.
        self.abort: FinishReason | None = None
        self.finished = False
        #: Trio clock at admission to a running slot, and at the first sampled token.
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None

    def send(self, item: Output) -> None:
        self.sender.send(item)

    @property
    def scores_prompt(self) -> bool:
        """Prompt logprobs were asked for (so the prompt is computed even when no token
        is to be generated)."""
        return (
            self.hooks is not None
            and self.hooks.logprobs is not None
            and self.hooks.logprobs.spec.start_len >= 0
        )

    def emit_frame(self) -> None:
        # Once per token of every running request: kept to the plain attribute reads.
        output_ids = self.output_ids
        ids = output_ids[self.emitted_ids :]
        self.emitted_ids = n = len(output_ids)
        self.sender.send(
            Frame(
                self.rid,
                self.detok.take_delta(final=False),
                ids,
                len(self.prompt_ids),
                n,
                self.cached_tokens,
                None if self.hooks is None else self._logprobs(),
            )
        )

    def emit_done(self, reason: FinishReason) -> None:
        text = self.detok.take_delta(final=True)
        ids = self.output_ids[self.emitted_ids :]
        self.emitted_ids = len(self.output_ids)
        self.finished = True
        self.send(
            Done(
                self.rid,
                text,
                ids,
                *self._counts(),
                finish_reason=reason,
                logprobs=self._logprobs(),
                admitted_at=self.admitted_at,
                first_token_at=self.first_token_at,
                speculative=None if self.spec is None else self.spec.counts(),
            )
        )
        self.sender.close()

    def _logprobs(self) -> Logprobs | None:
        if self.hooks is None or self.hooks.logprobs is None:
            return None
        return self.hooks.logprobs.take()

    def emit_error(self, error: EngineError) -> None:
        self.finished = True
        self.send(Error(self.rid, error))
        self.sender.close()

    def _counts(self) -> tuple[int, int, int]:
        return len(self.prompt_ids), len(self.output_ids), self.cached_tokens

    def check_finished(self, token: int, eos: frozenset[int]) -> FinishReason | None:
        """The finish reason if `token`, just appended to `output_ids`, ends the request,
        else None (its text goes to the detokenizer, unless it is a stop token that ends it).

        SGLang's order: the length limit first (a token that reaches it is ordinary text,
        even an EOS or the end of a stop string); then stop tokens; then stop strings.

        `min_new_tokens`: the first min_new_tokens tokens can be neither a stop token (they
        are masked when sampling, `StepPlanner._suppress`) nor the end of a stop string.
        """
        params = self.params
        n = len(self.output_ids)
        if n >= self.max_new_tokens:
            self.detok.add(token, check_stops=False, last=True)
            return length_reason(n if params.max_new_tokens is None else params.max_new_tokens)
        may_stop = n > params.min_new_tokens
        is_stop_token = not params.ignore_eos and (token in eos or token in params.stop_token_ids)
        if is_stop_token and may_stop:
            return stop_reason(token)  # counted in output_ids, never rendered into text
        matched = self.detok.add(token, check_stops=may_stop)
        if matched is not None:
            return stop_reason(matched)
        grammar = self.hooks.grammar if self.hooks is not None else None
        if grammar is not None and grammar.finished:
            return stop_reason(token)  # SGLang: a grammar that ends stops on its last token
        return None
