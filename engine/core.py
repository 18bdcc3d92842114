"""`open_engine` and `Engine`: the model, its scheduler task, and the request API.

Synopsis::

    async with open_engine(EngineConfig()) as engine:
        params = SamplingParams.from_dict({"temperature": 0})
        async with engine.submit(GenerateRequest(text="Hello", sampling=params)) as stream:
            async for item in stream:
                print(item.text, end="")

What `submit` works out for a request before it queues (prompt ids, grammar, logit hooks,
SGLang's checks) is `intake.py`'s; the load and idle snapshots are `load.py`'s. What the
engine can do beyond `EngineService` (tokenize, flush its cache) is declared in
`capabilities.py`.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from collections.abc import Sequence as SequenceOf
from contextlib import asynccontextmanager, contextmanager

import trio

from .config import EngineConfig
from .detokenize import IncrementalDetokenizer
from .embeddings import Embeddings, Embeds
from .errors import BadRequest, DuplicateRequestId, EngineClosed, QueueFull
from .intake import (
    Intake,
    bind_request_view,
    check_context,
    grammar_kind,
    needs_preparing,
    prepared_for,
)
from .interface import EngineLoad
from .load import IdleReport, current_load, idle_report
from .offload import MARKS, off_loop, runs_inline
from .request import (
    EngineStats,
    GenerateRequest,
    ModelInfo,
    abort_reason,
    abort_targets,
    counts_as_request,
)
from .runners.base import FindsSpecialTokens, Runner, StopsDecoding
from .scheduler import Scheduler, Sequence
from .service_nursery import open_service_nursery
from .stream import RequestStream, open_output_channel

__all__ = ["Engine", "open_engine", "open_runner"]


@asynccontextmanager
async def open_engine(
    config: EngineConfig | None = None, *, runner: Runner | None = None
) -> AsyncIterator[Engine]:
    """Load the model, run the scheduler, and yield the `Engine`.

    Loading happens off the event loop (for llama.cpp, on its compute thread), so the calling
    Trio program stays responsive. When the block exits (normally, by error or by
    cancellation), every request still in flight ends with an abort (status 503), the
    scheduler stops after its current step (a llama.cpp decode in flight is given up), and
    the model is freed. Errors raised in the block reach the caller unwrapped.

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
                    if engine._embeddings is not None:  # each after its decode, given up next
                        engine._embeddings.abort("The engine is shutting down.")
                    if isinstance(runner, StopsDecoding):
                        # Its requests all end now: the decode in flight is not worth
                        # waiting for (under CPU load one takes seconds).
                        runner.stop_decoding()
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
        from .compute_thread import compute_thread
        from .runners.llama import LlamaRunner

        # A model loaded after its caller left (Ctrl-C during the load) is freed, not leaked.
        return await compute_thread().run(LlamaRunner.load, config, orphan=LlamaRunner.close)
    if config.runner == "sim":
        from .runners.sim import SimRunner

        return SimRunner(
            context_length=config.context_length or 8192,
            latency=config.sim_latency,
            fail_at_step=config.sim_fail_at_step,
            chat_template=config.chat_template,
        )
    raise ValueError(f"unknown runner {config.runner!r}; expected 'llama' or 'sim'")


class Engine:
    """Submit requests, abort them, and look at the model. Create with `open_engine`.

    Every method is synchronous and never blocks: submit validates and enqueues, abort marks.
    Beyond `EngineService`, it has the model's vocabulary and a prefix cache (the
    `TokenizerService` and `CacheService` capabilities); it has no workers.
    """

    def __init__(self, runner: Runner, config: EngineConfig) -> None:
        self.config = config
        self._runner = runner
        info = runner.info
        self._scheduler = Scheduler(
            runner, config, kv_total_cells=config.kv_cells(info.context_length)
        )
        self._scheduler.on_finish(self._forget)
        self._intake = Intake(runner, config)
        self._live: dict[str, Sequence] = {}
        self._closed = False
        self._nursery: trio.Nursery | None = None  # set by open_engine
        self._scheduler_tasks: frozenset[trio.lowlevel.Task] = frozenset()
        # Worker threads using the model's vocabulary (tokenizing, compiling a grammar):
        # the model is freed only once none is left (open_engine).
        self._model_lock = threading.Lock()
        self._model_users = 0
        # What special tokens begin with, for weighing a text's tokenizing (offload.work).
        self._marks: str | None = (
            runner.special_marks if isinstance(runner, FindsSpecialTokens) else MARKS
        )
        self._embeddings = (
            Embeddings(
                runner,
                model_name=info.name,
                vocab_size=info.vocab_size,
                check_open=self._check_open,
            )
            if isinstance(runner, Embeds)
            else None
        )

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
        an abort may wait for the step boundary that acts on it. An embedding decode counts
        as a step: one compute-thread job that a step may queue behind."""
        embedding = self._embeddings.slowest_recent_decode() if self._embeddings else 0.0
        return max(max(self._scheduler.step_times, default=0.0), embedding)

    def load(self) -> EngineLoad:
        """What SGLang's `/get_load` reports, from the scheduler's live state: a request
        whose client left stops counting at once (its sequence is marked), and its KV cells
        at the next step boundary, when they are freed."""
        return current_load(self._scheduler, self._runner)

    def idle_report(self) -> IdleReport:
        """What the engine still holds for requests, for leak checks in tests: every field is
        zero or empty once every request has ended and its sequence has been reaped. An
        aborted request gives up its rid at once but its slot and KV cells only at the next
        step boundary (at most one step later). An engine whose scheduler task has ended
        (closed, or its scheduler died) is never idle."""
        nursery = self._nursery
        alive = nursery is not None and bool(self._scheduler_tasks & nursery.child_tasks)
        return idle_report(
            self._scheduler,
            self._runner,
            rids=tuple(self._live),
            scheduler_alive=alive and not self._closed,
        )

    @property
    def embeddings(self) -> Embeddings | None:
        """Embeddings of the served model (the `EmbeddingService` capability); None where
        the runner computes none."""
        return self._embeddings

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
        todo = [i for i, item in enumerate(items) if needs_preparing(item)]
        if not todo:
            return items
        wanted = [items[i] for i in todo]
        texts = {item.text for item in wanted if item.input_ids is None and item.text is not None}
        if any(grammar_kind(item.sampling) for item in wanted) or not runs_inline(
            *texts, marks=self._marks
        ):
            done = await off_loop(self._prepare_all, wanted)
        else:
            done = self._prepare_all(wanted)
        for i, prepared in zip(todo, done, strict=True):
            items[i] = prepared
        return items

    def _prepare_all(self, items: list[GenerateRequest]) -> list[GenerateRequest]:
        """`prepare`'s work for `items` (`Intake.prepare_all`), with the model held open."""
        with self._using_model():
            return self._intake.prepare_all(items)

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
        prepared = prepared_for(request)
        if prepared is None:
            prompt_ids = self._intake.prompt_ids(request)
        elif prepared.prompt_error is not None:
            raise prepared.prompt_error
        else:
            assert prepared.prompt_ids is not None
            prompt_ids = list(prepared.prompt_ids)
        rid = request.rid if request.rid is not None else uuid.uuid4().hex
        if rid in self._live:
            raise DuplicateRequestId(rid)
        max_new = check_context(len(prompt_ids), params.max_new_tokens, info.context_length)
        if self._scheduler.queue_depth() >= self.config.max_queued_requests:
            if counts_as_request(rid):
                self._scheduler.aborted_requests += 1
            raise QueueFull("The request queue is full.")  # SGLang's words; clients match them
        hooks = self._intake.hooks(request, prompt_ids, rid, prepared)
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
            bind_request_view(hooks.processor, seq)
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

    def abort_all(self, *, message: str = "Aborted", status_code: int | None = None) -> int:
        """Abort every request in flight; see `abort`. Embedding requests too, each after its
        decode in flight, with `status_code` (503 without one: they have no partial answer)."""
        embeddings = self._abort_embeddings(message, status_code, running=True)
        return self._abort(list(self._live.values()), message, status_code) + embeddings

    def abort_waiting(self, *, message: str = "Aborted", status_code: int | None = None) -> int:
        """Abort every request still queued for a slot (not the running ones); each ends at
        once, as `abort` ends a queued request; so do embedding requests waiting their turn."""
        embeddings = self._abort_embeddings(message, status_code, running=False)
        return self._abort(list(self._scheduler.waiting), message, status_code) + embeddings

    def _abort_embeddings(self, message: str, status_code: int | None, *, running: bool) -> int:
        if self._embeddings is None:
            return 0
        return self._embeddings.abort(message, status=status_code or 503, running=running)

    def _abort(self, seqs: list[Sequence], message: str, status_code: int | None) -> int:
        err_type = None if status_code is None else "aborted"
        for seq in seqs:
            self._scheduler.mark_abort(
                seq, abort_reason(message, status_code=status_code, err_type=err_type)
            )
        return len(seqs)

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

    def _forget(self, seq: Sequence) -> None:
        if self._live.get(seq.rid) is seq:
            del self._live[seq.rid]
