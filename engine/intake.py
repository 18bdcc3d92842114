"""A request's intake: what `Engine.submit` works out for it before it queues (its prompt
ids, its grammar, its logit hooks) and SGLang's checks on them, and what `Engine.prepare`
does of that work ahead of `submit`, off the event loop.

Synopsis::

    intake = Intake(runner, config)
    done = intake.prepare_all(items)       # PreparedRequests: prompt ids, grammars compiled
    prompt_ids = intake.prompt_ids(request)
    hooks = intake.hooks(request, prompt_ids, prepared_for(request))

Every check raises a `BadRequest` (or `ContextLengthExceeded`) with SGLang's wording; none
touches the scheduler. `prepare_all` must run while the model is held open
(`Engine._using_model`): it tokenizes and compiles with the model's vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from .config import EngineConfig
from .custom_logit_processor import load_processor
from .errors import BadRequest, ContextLengthExceeded
from .grammar import GRAMMAR_KINDS, LlgMatcher
from .logits import LogitHooks, LogprobCollector, ProcessorCall
from .request import GenerateRequest, LogprobRequest
from .runners.base import BoundsTokenCount, Runner
from .sampling import SamplingParams
from .scheduler import Sequence
from .token_ids import check_prompt_ids, check_token_ids

__all__ = [
    "Intake",
    "Prepared",
    "PreparedRequest",
    "bind_request_view",
    "check_context",
    "grammar_kind",
    "needs_preparing",
    "prepared_for",
    "tokens_at_least",
]


class Prepared:
    """What `Engine.prepare` computed for a request, and from what: its prompt ids (or the
    error tokenizing raised) and its compiled grammar (or the error compiling raised)."""

    __slots__ = (
        "grammar",
        "grammar_error",
        "input_ids",
        "prompt_error",
        "prompt_ids",
        "sampling",
        "text",
    )

    def __init__(self, request: GenerateRequest) -> None:
        self.text: str | None = request.text
        self.input_ids = request.input_ids
        self.sampling = request.sampling
        self.prompt_ids: list[int] | None = None
        self.prompt_error: Exception | None = None
        #: The compiled matcher, handed to one submit only (it holds the sequence's state).
        self.grammar: LlgMatcher | None = None
        self.grammar_error: Exception | None = None

    def fits(self, request: GenerateRequest) -> bool:
        """Whether this was computed from `request`'s own prompt and sampling params."""
        return (
            request.text is self.text
            and request.input_ids is self.input_ids
            and request.sampling is self.sampling
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreparedRequest(GenerateRequest):
    """A `GenerateRequest` that `Engine.prepare` has tokenized and whose grammar it has
    compiled, off the event loop; `Engine.submit` takes it like any request and skips that
    work."""

    prepared: Prepared = dataclasses.field(repr=False, compare=False)


class Intake:
    """The model-facing half of `Engine.submit`: a request's prompt ids, grammar and logit
    hooks, each checked as SGLang checks them. Safe to call from a worker thread while the
    model is held open."""

    def __init__(self, runner: Runner, config: EngineConfig) -> None:
        self._runner = runner
        self.config = config
        #: The runner's linear-time lower bound on a text's ids, if it has one (checked once).
        self._tokens_at_least: Callable[[str], int] | None = (
            runner.tokens_at_least if isinstance(runner, BoundsTokenCount) else None
        )

    def prepare_all(self, items: list[GenerateRequest]) -> list[GenerateRequest]:
        """`Engine.prepare`'s work for `items`, in one go (a worker thread, or the loop when
        cheap): each distinct text tokenized once, each distinct grammar compiled once."""
        prompts: dict[str, tuple[list[int] | None, Exception | None]] = {}
        results = []
        for request in items:
            prepared = Prepared(request)
            if request.input_ids is None and request.text is not None:
                if request.text not in prompts:
                    try:
                        prompts[request.text] = (self.prompt_ids(request), None)
                    except Exception as exc:
                        prompts[request.text] = (None, exc)
                prepared.prompt_ids, prepared.prompt_error = prompts[request.text]
            else:
                try:
                    prepared.prompt_ids = self.prompt_ids(request)
                except Exception as exc:
                    prepared.prompt_error = exc
            results.append(prepared)
        grammars: dict[tuple[str, str], tuple[LlgMatcher | None, Exception | None]] = {}
        for request, prepared in zip(items, results, strict=True):
            kind = grammar_kind(request.sampling)
            if kind is None or prepared.prompt_error is not None:
                continue  # submit raises the prompt's error first: no grammar needed
            key = (kind, getattr(request.sampling, kind))
            if key not in grammars:
                try:
                    grammars[key] = (self.grammar(request.sampling), None)
                except Exception as exc:
                    grammars[key] = (None, exc)
                prepared.grammar, prepared.grammar_error = grammars[key]
            else:
                # The compiled grammar is shared; each sequence gets its own position in
                # it (about a microsecond a copy, measured).
                compiled, prepared.grammar_error = grammars[key]
                prepared.grammar = None if compiled is None else compiled.copy()
        fields = [f.name for f in dataclasses.fields(GenerateRequest)]
        return [
            PreparedRequest(**{name: getattr(request, name) for name in fields}, prepared=prepared)
            for request, prepared in zip(items, results, strict=True)
        ]

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The request's prompt: its `input_ids` checked against the vocabulary, or its text
        tokenized (a text that can never fit the context is refused before tokenizing)."""
        vocab = self._runner.info.vocab_size
        if request.input_ids is not None:
            ids = request.input_ids
            check_prompt_ids(ids, vocab)
            return list(ids)
        if request.text is None:
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        context = self._runner.info.context_length
        if len(request.text) >= context and self._tokens_at_least is not None:
            # A cheap lower bound first (linear, no tokenizing): a text that can never fit
            # is refused before the tokenizer spends time on it.
            at_least = self._tokens_at_least(request.text)
            if at_least >= context:
                raise ContextLengthExceeded(
                    f"The input (at least {at_least} tokens) is longer than the model's "
                    f"context length ({context} tokens)."
                )
        ids = self._runner.tokenize(request.text, add_special=True)
        if not ids:
            raise BadRequest("texts cannot be empty and tokenizer must be initialized")
        return ids

    def hooks(
        self,
        request: GenerateRequest,
        prompt_ids: list[int],
        rid: str,
        prepared: Prepared | None = None,
    ) -> LogitHooks | None:
        """The per-sequence logits work a request needs, or None (most requests)."""
        params = request.sampling
        logprobs = None
        if request.logprobs is not None:
            spec = request.logprobs
            vocab = self._runner.info.vocab_size
            _check_logprob_request(spec, len(prompt_ids), vocab)
            logprobs = LogprobCollector(spec)
            logprobs.start_prompt(prompt_ids)
        processor = None
        if request.custom_logit_processor:
            if not self.config.enable_custom_logit_processor:
                raise BadRequest(
                    "The server is not configured to enable custom logit processor. Please "
                    "set `--enable-custom-logit-processor` to enable this feature."
                )
            custom = params.custom_params
            # SGLang hands the processor the request's own dict (plus `__req__`) on every
            # call, so state it keeps there persists from token to token.
            processor = ProcessorCall(
                load_processor(request.custom_logit_processor),
                dict(custom) if isinstance(custom, Mapping) else None,
            )
        if prepared is not None and prepared.grammar_error is not None:
            raise prepared.grammar_error
        if prepared is not None and prepared.grammar is not None:
            grammar: LlgMatcher | None = prepared.grammar
            prepared.grammar = None  # one sequence's state: a second submit compiles anew
        else:
            grammar = self.grammar(params)
        if logprobs is None and processor is None and grammar is None:
            return None
        return LogitHooks(
            grammar=grammar, processor=processor, logprobs=logprobs, logit_bias=params.logit_bias
        )

    def grammar(self, params: SamplingParams) -> LlgMatcher | None:
        """The request's grammar, compiled and checked now (a 400 before anything is queued).
        An empty grammar string means none, as in SGLang."""
        kind = grammar_kind(params)
        if kind is None:
            return None
        if self._runner.grammars is None:
            raise BadRequest(
                f"{kind} needs a runner with a vocabulary (the llama runner); "
                f"this engine's runner ({type(self._runner).__name__}) cannot constrain decoding."
            )
        return self._runner.grammars.matcher(kind, getattr(params, kind))


def grammar_kind(params: SamplingParams) -> str | None:
    """The grammar field a request uses (an empty string means none, as in SGLang)."""
    return next((k for k in GRAMMAR_KINDS if getattr(params, k)), None)


def needs_preparing(request: GenerateRequest) -> bool:
    """Whether `prepare` has anything to do for `request`: a text to tokenize or a grammar
    to compile, not already done for this very request."""
    if isinstance(request, PreparedRequest) and request.prepared.fits(request):
        return False
    text = request.input_ids is None and request.text is not None
    return text or grammar_kind(request.sampling) is not None


def prepared_for(request: GenerateRequest) -> Prepared | None:
    """What `prepare` computed for this very request, if anything (a request rebuilt with
    another prompt or other params is worked out afresh)."""
    if isinstance(request, PreparedRequest) and request.prepared.fits(request):
        return request.prepared
    return None


def tokens_at_least(runner: Runner, text: str) -> int:
    """A lower bound on `len(runner.tokenize(text))`, in linear time without tokenizing: the
    runner's `tokens_at_least` if it `BoundsTokenCount` (the llama runner counts special
    tokens, one id each), or 0. `Intake` resolves the feature once instead."""
    return runner.tokens_at_least(text) if isinstance(runner, BoundsTokenCount) else 0


class _RequestView:
    """What SGLang's processors read from `custom_params["__req__"]`: the request's ids (live:
    `output_ids` grows as tokens are generated) and its rid."""

    def __init__(self, seq: Sequence) -> None:
        self.rid = seq.rid
        self.origin_input_ids = seq.prompt_ids
        self.output_ids = seq.output_ids


def bind_request_view(call: ProcessorCall, seq: Sequence) -> None:
    """Put the sequence's live view in the processor's params (`__req__`), as SGLang does."""
    if call.params is not None:
        call.params["__req__"] = _RequestView(seq)


def _check_logprob_request(spec: LogprobRequest, prompt_len: int, vocab: int) -> None:
    """SGLang's checks and messages for the logprob fields."""
    if spec.start_len > prompt_len:
        raise BadRequest(
            f"req.logprob_start_len={spec.start_len} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={prompt_len}. Please use a smaller logprob_start_len."
        )
    if spec.start_len < -1:
        raise BadRequest(f"logprob_start_len must be -1 or at least 0, got {spec.start_len}.")
    if spec.top_n < 0:
        raise BadRequest(f"top_logprobs_num must be at least 0, got {spec.top_n}.")
    check_token_ids("token_ids_logprob", spec.token_ids or (), vocab)


def check_context(prompt_len: int, max_new_tokens: int | None, context: int) -> int:
    """SGLang's two context checks; returns max_new_tokens made concrete."""
    if prompt_len >= context:
        raise ContextLengthExceeded(
            f"The input ({prompt_len} tokens) is longer than the model's context length "
            f"({context} tokens)."
        )
    if max_new_tokens is None:
        return context - prompt_len
    if prompt_len + max_new_tokens > context:
        raise ContextLengthExceeded(
            "Requested token count exceeds the model's maximum context length of "
            f"{context} tokens. You requested a total of {prompt_len + max_new_tokens} "
            f"tokens: {prompt_len} tokens from the input messages and {max_new_tokens} "
            "tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit."
        )
    return max_new_tokens
