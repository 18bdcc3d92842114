"""`open_engine` and `Engine`: the model, its scheduler task, and the request API.

Synopsis::

    async with open_engine(EngineConfig()) as engine:
        params = SamplingParams.from_dict({"temperature": 0})
        async with engine.submit(GenerateRequest(text="Hello", sampling=params)) as stream:
            async for item in stream:
                print(item.text, end="")
"""

from __future__ import annotations

import dataclasses
import math
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from collections.abc import Sequence as SequenceOf
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import trio

from .config import EngineConfig
from .custom_logit_processor import load_processor
from .detokenize import IncrementalDetokenizer
from .errors import (
    BadRequest,
    ContextLengthExceeded,
    DuplicateRequestId,
    EngineClosed,
    NotSupported,
    QueueFull,
)
from .grammar import GRAMMAR_KINDS, LlgMatcher
from .logits import LogitHooks, LogprobCollector, ProcessorCall
from .offload import MARKS, off_loop, runs_inline
from .request import (
    EngineStats,
    GenerateRequest,
    LogprobRequest,
    ModelInfo,
    WorkerStats,
    abort_reason,
    abort_targets,
    counts_as_request,
)
from .runners.base import Runner
from .sampling import SamplingParams
from .scheduler import Scheduler, Sequence

if TYPE_CHECKING:
    from .remote.passthrough import Answer
from .service_nursery import open_service_nursery
from .stream import RequestStream, open_output_channel

__all__ = ["Engine", "EngineLoad", "IdleReport", "PreparedRequest", "open_engine"]


@asynccontextmanager
async def open_engine(
    config: EngineConfig | None = None, *, runner: Runner | None = None
) -> AsyncIterator[Engine]:
    """Load the model, run the scheduler, and yield the `Engine`.

    Loading happens off the event loop (for llama.cpp, on its compute thread), so the calling
    Trio program stays responsive. When the block exits (normally, by error or by
    cancellation), every request still in flight ends with an abort (status 503), the
    scheduler stops after its current step, and the model is freed. Errors raised in the
    block reach the caller unwrapped.

    `runner`: a runner built by the caller (any object that implements
    `tributary.engine.runners.base.Runner`, see docs/runners.md), driven instead of the one
    `config.runner` names; the engine owns it from here on and calls its `close()` on exit.
    """
    config = config or EngineConfig()
    if runner is None:
        runner = await open_runner(config)
    try:
        engine = Engine(runner, config)
        try:
            async with open_service_nursery() as nursery:
                await nursery.start(engine._scheduler.run)
                engine._nursery = nursery
                engine._scheduler_tasks = frozenset(nursery.child_tasks)
                try:
                    yield engine
                finally:
                    # Closed before the scheduler is cancelled: no submit (nor worker thread)
                    # starts while it winds down. An engine never yielded needs no closing.
                    engine._close()
                    nursery.cancel_scope.cancel()
        finally:
            # A worker thread still tokenizing (its caller left) finishes before the model
            # is freed under it; its work is bounded by what one request may send.
            with trio.CancelScope(shield=True):
                await engine._model_released()
    finally:
        runner.close()


async def open_runner(config: EngineConfig) -> Runner:
    """Build the runner `config.runner` names, off the event loop (llama.cpp loads on its
    compute thread)."""
    if config.runner == "llama":
        from .runners.llama import LlamaRunner, compute_thread

        # A model loaded after its caller left (Ctrl-C during the load) is freed, not leaked.
        return await compute_thread().run(LlamaRunner.load, config, orphan=LlamaRunner.close)
    if config.runner == "sim":
        from .runners.sim import SimRunner

        return SimRunner(
            context_length=config.context_length or 8192,
            latency=config.sim_latency,
            fail_at_step=config.sim_fail_at_step,
        )
    raise ValueError(f"unknown runner {config.runner!r}; expected 'llama' or 'sim'")


class _Prepared:
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

    prepared: _Prepared = dataclasses.field(repr=False, compare=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineLoad:
    """The load a router balances on (SGLang's `GetLoadReqOutput`)."""

    num_reqs: int  # running (not aborted) plus waiting
    num_waiting_reqs: int  # submitted, not yet admitted
    num_tokens: int  # KV cells in use plus the prompt tokens of waiting requests


@dataclasses.dataclass(frozen=True)
class IdleReport:
    """What an engine still holds (`Engine.idle_report`): all zero and empty when idle."""

    running: int  # sequences admitted to a runner slot (aborted ones until they are reaped)
    waiting: int  # submitted, not yet admitted
    kv_used_cells: int  # as the runner counts them
    slots_held: int  # runner slots not back in the free list
    rids: tuple[str, ...]  # request ids still in flight (not yet ended or aborted)
    cache_pins: int  # prefix cache entries held for restores not yet run
    # The scheduler task is still running. False once it has ended: the engine has closed,
    # or its scheduler died (an engine that can no longer serve is not idle, it is broken).
    scheduler_alive: bool

    @property
    def idle(self) -> bool:
        return self.scheduler_alive and not (
            self.running
            or self.waiting
            or self.kv_used_cells
            or self.slots_held
            or self.rids
            or self.cache_pins
        )


class Engine:
    """Submit requests, abort them, and look at the model. Create with `open_engine`.

    Every method is synchronous and never blocks: submit validates and enqueues, abort marks.
    """

    serves_remotely = False

    def __init__(self, runner: Runner, config: EngineConfig) -> None:
        self.config = config
        self._runner = runner
        info = runner.info
        self._scheduler = Scheduler(
            runner, config, kv_total_cells=config.kv_cells(info.context_length)
        )
        self._scheduler.on_finish(self._forget)
        self._live: dict[str, Sequence] = {}
        self._closed = False
        self._nursery: trio.Nursery | None = None  # set by open_engine
        self._scheduler_tasks: frozenset[trio.lowlevel.Task] = frozenset()
        # Worker threads using the model's vocabulary (tokenizing, compiling a grammar):
        # the model is freed only once none is left (open_engine).
        self._model_lock = threading.Lock()
        self._model_users = 0
        # What special tokens begin with, for weighing a text's tokenizing (offload.work).
        self._marks: str | None = getattr(runner, "special_marks", MARKS)

    @property
    def capacity(self) -> int:
        """The most requests the engine takes at once: running slots plus queue places. A
        batch larger than this can never be accepted whole."""
        return self.config.max_running_requests + self.config.max_queued_requests

    @property
    def model_info(self) -> ModelInfo:
        return self._runner.info

    def stats(self) -> EngineStats:
        return self._scheduler.stats()

    def slowest_recent_step(self) -> float:
        """Seconds the slowest of the recent steps took (0 before the first step): how long
        an abort may wait for the step boundary that acts on it."""
        return max(self._scheduler.step_times, default=0.0)

    def load(self) -> EngineLoad:
        """What SGLang's `/get_load` reports, from the scheduler's live state: a request
        whose client left stops counting at once (its sequence is marked), and its KV cells
        at the next step boundary, when they are freed."""
        scheduler = self._scheduler
        waiting = len(scheduler.waiting)
        running = sum(1 for seq in scheduler.running if seq.abort is None)
        queued_tokens = sum(len(seq.prompt_ids) for seq in scheduler.waiting)
        return EngineLoad(
            num_reqs=running + waiting,
            num_waiting_reqs=waiting,
            num_tokens=self._runner.kv_used_cells() + queued_tokens,
        )

    def idle_report(self) -> IdleReport:
        """What the engine still holds for requests, for leak checks in tests: every field is
        zero or empty once every request has ended and its sequence has been reaped. An
        aborted request gives up its rid at once but its slot and KV cells only at the next
        step boundary (at most one step later). An engine whose scheduler task has ended
        (closed, or its scheduler died) is never idle."""
        scheduler = self._scheduler
        nursery = self._nursery
        alive = nursery is not None and bool(self._scheduler_tasks & nursery.child_tasks)
        return IdleReport(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            kv_used_cells=self._runner.kv_used_cells(),
            slots_held=scheduler.max_running - len(scheduler._free_slots),
            rids=tuple(self._live),
            cache_pins=scheduler.prefix_cache.pins if scheduler.prefix_cache is not None else 0,
            scheduler_alive=alive and not self._closed,
        )

    def flush_cache(self) -> bool:
        """Empty the prefix cache. As in SGLang, only an idle engine flushes: with requests
        running or waiting it returns False and drops nothing."""
        self._check_open()
        return self._scheduler.flush_prefix_cache()

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """The model's ids for `text`. Safe to call from a worker thread (`offload.off_loop`),
        as the HTTP layer does for large texts: the model is not freed while it runs."""
        with self._using_model():
            return self._runner.tokenize(text, add_special=add_special)

    def detokenize(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`. Safe to call from a worker thread, as `tokenize`."""
        with self._using_model():
            vocab = self._runner.info.vocab_size
            for token in ids:
                if not 0 <= token < vocab:
                    raise BadRequest(f"token id {token} is out of the vocabulary [0, {vocab}).")
            piece = self._runner.token_piece
            return b"".join(piece(t, special=not skip_special_tokens) for t in ids).decode(
                errors="replace"
            )

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes, control tokens spelled out (`<|im_end|>`): what logprob
        entries show for a token. A token may hold part of a UTF-8 character."""
        self._check_open()
        return self._runner.token_piece(token_id, special=True)

    async def prepare(self, items: SequenceOf[GenerateRequest]) -> list[GenerateRequest]:
        """Do the slow part of `submit` for all of one request's `items` (a batch, or n
        copies) together, off the event loop: tokenize their texts (each distinct text
        once) and compile their grammars (each distinct grammar once, every item then getting
        its own copy of the matcher's state), and return `PreparedRequest`s carrying the
        results for `submit`, which then skips that work.

        The work is weighed for all the items at once (`offload.work`): up to
        `offload.INLINE_WORK` (about a millisecond) it is done here, on the event loop;
        past it, and whenever a grammar is compiled, in one worker-thread job. Items with
        nothing to do (token ids, no grammar) come back as they are.

        Raises QueueFull at once, before any work, when the items cannot all fit the
        queue's free places (as `submit` would for the first one past them); nothing is
        counted then (the caller counts the refused items: `count_refused`). Other errors
        are not raised here: `submit` raises them, at the point and in the order it always
        has. Cancelling the caller returns at once (the thread finishes its bounded work on
        its own). `submit` without `prepare` does the same work inline.
        """
        self._check_open()
        items = list(items)
        free = self.config.max_queued_requests - self._scheduler.queue_depth()
        if len(items) > free:
            raise QueueFull("The request queue is full.")  # as submit's own refusal
        todo = [i for i, item in enumerate(items) if _needs_preparing(item)]
        if not todo:
            return items
        wanted = [items[i] for i in todo]
        texts = {item.text for item in wanted if item.input_ids is None and item.text is not None}
        if any(_grammar_kind(item.sampling) for item in wanted) or not runs_inline(
            *texts, marks=self._marks
        ):
            done = await off_loop(self._prepare_all, wanted)
        else:
            done = self._prepare_all(wanted)
        for i, prepared in zip(todo, done, strict=True):
            items[i] = prepared
        return items

    def _prepare_all(self, items: list[GenerateRequest]) -> list[GenerateRequest]:
        """`prepare`'s work for `items`, in one go (a worker thread, or the loop when cheap):
        each distinct text tokenized once, each distinct grammar compiled once."""
        with self._using_model():
            prompts: dict[str, tuple[list[int] | None, Exception | None]] = {}
            results = []
            for request in items:
                prepared = _Prepared(request)
                if request.input_ids is None and request.text is not None:
                    if request.text not in prompts:
                        try:
                            prompts[request.text] = (self._prompt_ids(request), None)
                        except Exception as exc:
                            prompts[request.text] = (None, exc)
                    prepared.prompt_ids, prepared.prompt_error = prompts[request.text]
                else:
                    try:
                        prepared.prompt_ids = self._prompt_ids(request)
                    except Exception as exc:
                        prepared.prompt_error = exc
                results.append(prepared)
            grammars: dict[tuple[str, str], tuple[LlgMatcher | None, Exception | None]] = {}
            for request, prepared in zip(items, results, strict=True):
                kind = _grammar_kind(request.sampling)
                if kind is None or prepared.prompt_error is not None:
                    continue  # submit raises the prompt's error first: no grammar needed
                key = (kind, getattr(request.sampling, kind))
                if key not in grammars:
                    try:
                        grammars[key] = (self._grammar(request.sampling), None)
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

    def submit(self, request: GenerateRequest) -> RequestStream:
        """Validate and enqueue `request`; return its stream at once.

        Raises BadRequest (and subclasses: invalid sampling params, context too long,
        duplicate in-flight rid), QueueFull, or EngineClosed. Nothing is enqueued when it
        raises. The caller owns the returned stream and should use it in `async with`.
        """
        self._check_open()
        info = self._runner.info
        params = request.sampling
        params.verify(info.vocab_size)
        if params.n != 1:
            # Silently running one sample for n > 1 would be a wrong answer, not a degraded one.
            raise BadRequest(
                f"n={params.n}: the engine runs one sample per request; submit n requests "
                "(the HTTP layer expands n this way)."
            )
        prepared = _prepared_for(request)
        if prepared is None:
            prompt_ids = self._prompt_ids(request)
        elif prepared.prompt_error is not None:
            raise prepared.prompt_error
        else:
            assert prepared.prompt_ids is not None
            prompt_ids = list(prepared.prompt_ids)
        rid = request.rid if request.rid is not None else uuid.uuid4().hex
        if rid in self._live:
            raise DuplicateRequestId(rid)
        max_new = _check_context(len(prompt_ids), params.max_new_tokens, info.context_length)
        if self._scheduler.queue_depth() >= self.config.max_queued_requests:
            if counts_as_request(rid):
                self._scheduler.aborted_requests += 1
            raise QueueFull("The request queue is full.")  # SGLang's words; clients match them
        hooks = self._hooks(request, prompt_ids, rid, prepared)
        sender, receiver = open_output_channel(rid)
        special = not params.skip_special_tokens
        seq = Sequence(
            rid=rid,
            prompt_ids=prompt_ids,
            params=params,
            max_new_tokens=max_new,
            stream_interval=params.stream_interval or self.config.stream_interval,
            detokenizer=IncrementalDetokenizer(
                lambda t: self._runner.token_piece(t, special=special),
                stops=params.stop,
                stop_regexes=params.stop_regex_patterns,
                no_stop_trim=params.no_stop_trim,
            ),
            sender=sender,
            hooks=hooks,
            stream=request.stream,
        )
        if hooks is not None and hooks.processor is not None:
            _bind_request_view(hooks.processor, seq)
        self._live[rid] = seq
        self._scheduler.enqueue(seq)
        return RequestStream(
            rid=rid,
            prompt_tokens=len(prompt_ids),
            receiver=receiver,
            abort=lambda: self._scheduler.mark_abort(seq, abort_reason()),
            abort_with=lambda reason: self._scheduler.mark_abort(seq, reason),
            sender=sender,
        )

    def abort(
        self,
        rid: str,
        *,
        fanout: bool = False,
        message: str = "Aborted",
        status_code: int | None = None,
    ) -> int:
        """Abort the in-flight request `rid`; with `fanout`, also the items a batch fanned
        out from it (`rid_0`, `rid_1`, ...), never other rids that merely share a prefix.
        Returns how many were aborted.

        Their streams end with a `Done` whose finish_reason is
        `{"type": "abort", "message", "status_code", "err_type"}`. Without a status code that
        is a normal ending (SGLang answers 200); with one, HTTP reports that status.
        """
        return self._abort(abort_targets(self._live, rid, fanout=fanout), message, status_code)

    def count_refused(self, requests: int) -> None:
        """Count `requests` more as refused by a full queue (`EngineStats.aborted_requests`):
        the rest of a batch whose submission stopped at a `QueueFull`, which never reached
        `submit` but were refused with it."""
        self._scheduler.aborted_requests += requests

    def open_passthrough(
        self, path: str, body: dict[str, Any], *, key: str | None, deadline: float = math.inf
    ) -> AbstractAsyncContextManager[Answer]:
        """Only a front has workers to hand a request to."""
        raise NotSupported("This server has its own model; it has no workers to forward to.")

    def abort_all(self, *, message: str = "Aborted", status_code: int | None = None) -> int:
        """Abort every request in flight; see `abort`."""
        return self._abort(list(self._live.values()), message, status_code)

    def abort_waiting(self, *, message: str = "Aborted", status_code: int | None = None) -> int:
        """Abort every request still queued for a slot (not the running ones); each ends at
        once, as `abort` ends a queued request."""
        return self._abort(list(self._scheduler.waiting), message, status_code)

    def _abort(self, seqs: list[Sequence], message: str, status_code: int | None) -> int:
        err_type = None if status_code is None else "aborted"
        for seq in seqs:
            self._scheduler.mark_abort(
                seq, abort_reason(message, status_code=status_code, err_type=err_type)
            )
        return len(seqs)

    def worker_stats(self) -> list[WorkerStats]:
        return []  # the model is in this process

    def add_worker(self, url: str, kind: str = "sglang") -> WorkerStats:
        # A 400, not a 501: the request is wrong for this server, which could never take it.
        raise BadRequest(
            "This server runs its own model; it has no workers (start it with --worker-url)."
        )

    def remove_worker(self, url: str) -> WorkerStats:
        return self.add_worker(url)

    def _check_open(self) -> None:
        # After open_engine's block the model is freed: touching it would crash the process.
        if self._closed:
            raise EngineClosed("The engine is shutting down.")

    @contextmanager
    def _using_model(self) -> Iterator[None]:
        """Hold the model open for the block, from any thread (EngineClosed once closing)."""
        with self._model_lock:
            self._check_open()
            self._model_users += 1
        try:
            yield
        finally:
            with self._model_lock:
                self._model_users -= 1

    def _close(self) -> None:
        with self._model_lock:
            self._closed = True

    async def _model_released(self) -> None:
        """Wait until no worker thread uses the model (after `_close`, none starts), nor a
        grammar compile whose caller stopped waiting for it (its tokenizer reads the
        vocabulary); a compile is bounded by the grammar checks, so 30 s only bounds a hang."""
        while self._model_users:
            await trio.sleep(0.005)
        if (grammars := self._runner.grammars) is not None:
            await trio.to_thread.run_sync(grammars.wait_idle, 30.0, abandon_on_cancel=True)

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        vocab = self._runner.info.vocab_size
        if request.input_ids is not None:
            ids = request.input_ids
            if not ids:
                raise BadRequest("input_ids cannot be empty.")
            for token in ids:
                if not 0 <= token < vocab:
                    raise BadRequest(
                        f"input_ids contains out-of-vocabulary token id {token}; "
                        f"valid range is [0, {vocab})."
                    )
            return list(ids)
        if request.text is None:
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        context = self._runner.info.context_length
        if len(request.text) >= context:
            # A cheap lower bound first (linear, no tokenizing): a text that can never fit
            # is refused before the tokenizer spends time on it.
            at_least = tokens_at_least(self._runner, request.text)
            if at_least >= context:
                raise ContextLengthExceeded(
                    f"The input (at least {at_least} tokens) is longer than the model's "
                    f"context length ({context} tokens)."
                )
        ids = self._runner.tokenize(request.text, add_special=True)
        if not ids:
            raise BadRequest("texts cannot be empty and tokenizer must be initialized")
        return ids

    def _hooks(
        self,
        request: GenerateRequest,
        prompt_ids: list[int],
        rid: str,
        prepared: _Prepared | None = None,
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
            grammar = self._grammar(params)
        if logprobs is None and processor is None and grammar is None:
            return None
        return LogitHooks(
            grammar=grammar, processor=processor, logprobs=logprobs, logit_bias=params.logit_bias
        )

    def _grammar(self, params: SamplingParams) -> LlgMatcher | None:
        """The request's grammar, compiled and checked now (a 400 before anything is queued).
        An empty grammar string means none, as in SGLang."""
        kind = _grammar_kind(params)
        if kind is None:
            return None
        if self._runner.grammars is None:
            raise BadRequest(
                f"{kind} needs a runner with a vocabulary (the llama runner); "
                f"this engine's runner ({type(self._runner).__name__}) cannot constrain decoding."
            )
        return self._runner.grammars.matcher(kind, getattr(params, kind))

    def _forget(self, seq: Sequence) -> None:
        if self._live.get(seq.rid) is seq:
            del self._live[seq.rid]


def _grammar_kind(params: SamplingParams) -> str | None:
    """The grammar field a request uses (an empty string means none, as in SGLang)."""
    return next((k for k in GRAMMAR_KINDS if getattr(params, k)), None)


def _needs_preparing(request: GenerateRequest) -> bool:
    """Whether `prepare` has anything to do for `request`: a text to tokenize or a grammar
    to compile, not already done for this very request."""
    if isinstance(request, PreparedRequest) and request.prepared.fits(request):
        return False
    text = request.input_ids is None and request.text is not None
    return text or _grammar_kind(request.sampling) is not None


def _prepared_for(request: GenerateRequest) -> _Prepared | None:
    """What `prepare` computed for this very request, if anything (a request rebuilt with
    another prompt or other params is worked out afresh)."""
    if isinstance(request, PreparedRequest) and request.prepared.fits(request):
        return request.prepared
    return None


def tokens_at_least(runner: Runner, text: str) -> int:
    """A lower bound on `len(runner.tokenize(text))`, in linear time without tokenizing: the
    runner's `tokens_at_least` (the llama runner counts special tokens, one id each), or 0."""
    bound = getattr(runner, "tokens_at_least", None)
    return 0 if bound is None else int(bound(text))


class _RequestView:
    """What SGLang's processors read from `custom_params["__req__"]`: the request's ids (live:
    `output_ids` grows as tokens are generated) and its rid."""

    def __init__(self, seq: Sequence) -> None:
        self.rid = seq.rid
        self.origin_input_ids = seq.prompt_ids
        self.output_ids = seq.output_ids


def _bind_request_view(call: ProcessorCall, seq: Sequence) -> None:
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
    for token in spec.token_ids or ():
        if not 0 <= token < vocab:
            raise BadRequest(
                f"token_ids_logprob contains out-of-vocabulary token id {token}; "
                f"valid range is [0, {vocab})."
            )


def _check_context(prompt_len: int, max_new_tokens: int | None, context: int) -> int:
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
