"""Continuous batching: one task owns every sequence and drives the runner step by step.

Each step:

1. reap: sequences marked aborted leave (KV freed, an abort `Done` sent);
2. admit: waiting requests take free slots, FIFO (each slot has a whole context of KV
   cells, and submit has checked the request fits one);
3. plan: one decode token per decoding sequence, plus at most one prompt chunk of each
   prefilling sequence, up to `max_prefill_tokens` in all; a sequence admitted in a burst
   (with others at one boundary, their prompts within `burst_prefill_tokens`) decodes only
   once the whole burst has its first tokens;
4. `await runner.step(plan)`;
5. commit: append sampled tokens, detokenize, check stop conditions, send `Frame`/`Done`.

Planning is `planner.py`; KV reuse (the prefix cache, forks of parallel samples) is
`kv_reuse.py`; one request's state and stop rules are `Sequence` (`sequence.py`).

A step whose sequences are all simply decoding (no prompt chunk, no logit hooks, no
min_new_tokens mask) is planned as a run (runners that `DecodesRuns`): the runner decodes
again and again without coming back between decodes, until the scheduler needs a step
boundary (a request arrives while a slot is free, one is aborted, one ends while others
wait for a slot), a request reaches its length or samples a stop token, or
`max_run_decodes`. Each decode's tokens are committed as they come when some request
streams or has stop strings or regexes, else once, at the run's end: a unary request then
costs the event loop nothing per token. What is computed is what the same steps would
compute; only the scheduler's wake-ups change.

With `--speculative-algorithm NGRAM` (engine/speculative.py), a decode may carry drafted
tokens; the runner verifies them, and the drafts it kept are committed before its sampled
token, one by one through the stop checks (`Speculation.expand`). A step with drafts is never
a run; one in which a speculating request found no draft may be a short run
(`SPEC_RUN_DECODES`), after which it looks for a draft again.

A request that arrives while others decode joins at the next step (a run ends after the
decode that is running). Aborts are marks (`Sequence.abort`); they take effect at the next
step boundary and never touch another sequence's output (an abort during a run first
commits what the run decoded before it, for every sequence, as single steps would have).
Output channels are unbounded, so a slow consumer never stalls the scheduler; what a
consumer has not read is bounded by its own request's length.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
from collections.abc import Callable, Iterable
from functools import partial

import trio

from ..config import EngineConfig
from ..errors import BadRequest, EngineError, RunnerFailure
from ..request import (
    EngineStats,
    FinishReason,
    abort_reason,
    counts_as_request,
    length_reason,
)
from ..runners.base import DecodeRun, DecodesRuns, ReportsKVBytes, Runner, SeqStep
from ..speculative import Speculation
from .kv_reuse import KVReuse
from .planner import StepPlanner
from .sequence import Sequence

__all__ = ["Scheduler"]

LOGGER = logging.getLogger("tributary.engine.scheduler")


#: Steps over which `Scheduler.step_times` remembers how long a step takes: enough to
#: include the last long prefill chunk of a busy engine, short enough to forget a past burst.
STEP_WINDOW = 64


class Scheduler:
    """The sequences of one engine and the task that steps them (`run`). Every other method
    is synchronous and never blocks, for the engine's other tasks."""

    def __init__(self, runner: Runner, config: EngineConfig, *, kv_total_cells: int) -> None:
        self.runner = runner
        self.max_running = config.max_running_requests
        self.kv_total_cells = kv_total_cells
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order
        # Lowest free slot first: llama.cpp splits a step into one graph per run of
        # consecutive sequence ids, so compact slots mean fewer graphs per step.
        self._free_slots = list(range(self.max_running))
        self._eos = runner.info.eos_token_ids
        #: Set when there is something to do; the idle scheduler task waits for it, then
        #: re-arms it. (trio_util's RepeatedEvent would re-arm it for us, through an
        #: AsyncValue and a predicate per wait: a few µs more per request on this path.)
        self._wakeup = trio.Event()
        self._on_finish: list[Callable[[Sequence], None]] = []
        self.steps = 0
        self.generated_tokens = 0
        #: Seconds the last STEP_WINDOW steps took on the runner (failed ones included).
        self.step_times: collections.deque[float] = collections.deque(maxlen=STEP_WINDOW)
        #: Requests refused (queue full) or ended with an abort finish_reason.
        self.aborted_requests = 0
        #: The runner, if it says how many bytes of KV it allocated (read at each `stats`).
        self._kv_reporter = runner if isinstance(runner, ReportsKVBytes) else None
        self._kv = KVReuse(runner, config)
        self.prefix_cache = self._kv.prefix_cache
        #: The runner, if it decodes runs (`DecodesRuns`); else every step is a single one.
        self._decoder = runner if isinstance(runner, DecodesRuns) and runner.decodes_runs else None
        self._planner = StepPlanner(
            config,
            eos=self._eos,
            max_run=config.max_run_decodes if self._decoder is not None else 1,
            kv=self._kv,
        )
        #: The run the runner is decoding, if any: a change that needs a step boundary
        #: (a request arrives or is aborted) ends it after the decode that is running.
        self._run: DecodeRun | None = None
        self._feeding = False  # within _commit_run
        #: Speculative decoding, if the server speculates (engine/speculative.py).
        self._spec = Speculation.for_config(config, runner)

    # -- called from other tasks (synchronous, never blocks) ----------------------------

    def enqueue(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._wakeup.set()
        if self._run is not None and len(self.running) < self.max_running:
            self._run.stop()  # admitted at the boundary right after the decode that is running

    def mark_abort(self, seq: Sequence, reason: FinishReason) -> None:
        """Abort `seq`: at once if it is still waiting, else at the next step boundary."""
        if seq.finished or seq.abort is not None:
            return
        run = self._run
        if run is not None and seq.slot is not None and not self._feeding:
            # What the run decoded before this abort counts, as single steps would have
            # committed it by now (unless this abort comes from within a feed, a consumer
            # reacting to what is being committed: the next feed commits the rest).
            run.feed_decoded()
            if seq.finished or seq.abort is not None:  # that was its end
                return
        seq.abort = reason
        # Its rid is free at once: a client that timed out may retry with the same rid
        # before the next step boundary reaps the old sequence.
        self._forget(seq)
        if seq.slot is None:
            self.waiting.remove(seq)
            # SGLang's wording for a plain abort of a queued request; a reason with a status
            # code (shutdown, say) is kept, since it decides what HTTP reports.
            if reason["status_code"] is None:
                reason = abort_reason("Abort in waiting queue")
            self._finish(seq, reason)
        elif self._run is not None:
            self._run.stop()  # reaped at the boundary right after the decode that is running
        self._wakeup.set()

    def queue_depth(self) -> int:
        """Requests that will have to wait for a slot: submitted requests sit in `waiting`
        until the next step boundary even when slots are free, so free slots are subtracted."""
        return len(self.waiting) - (self.max_running - len(self.running))

    def on_finish(self, callback: Callable[[Sequence], None]) -> None:
        self._on_finish.append(callback)

    def stats(self) -> EngineStats:
        cache = self.prefix_cache
        spec = self._spec
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_used_cells=self.runner.kv_used_cells(),
            kv_total_cells=self.kv_total_cells,
            steps=self.steps,
            generated_tokens=self.generated_tokens,
            aborted_requests=self.aborted_requests,
            kv_cache_bytes=0 if self._kv_reporter is None else int(self._kv_reporter.kv_bytes),
            prefix_cache_bytes=cache.bytes if cache is not None else 0,
            prefix_cache_entries=len(cache) if cache is not None else 0,
            prefix_cache_hits=cache.hits if cache is not None else 0,
            spec_verifies=spec.verifies if spec is not None else 0,
            spec_draft_tokens=spec.drafted if spec is not None else 0,
            spec_accepted_tokens=spec.accepted if spec is not None else 0,
        )

    def flush_prefix_cache(self) -> bool:
        """Empty the prefix cache, as SGLang's `/flush_cache` does: only when no request is
        running or waiting (else False, and nothing is dropped)."""
        if self.running or self.waiting:
            return False
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return True

    # -- the scheduler task -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                # A step on the compute thread is waited for shielded (the model is never
                # freed under a decode), so this is where cancellation (engine exit, Ctrl-C)
                # reaches a busy scheduler: at every step boundary.
                await trio.lowlevel.checkpoint_if_cancelled()
                self._reap()
                self._admit()
                if not self.running:
                    await self._wakeup.wait()
                    self._wakeup = trio.Event()
                    continue
                plan, sampling, stepped = self._planner.plan(self.running)
                run = self._planner.plan_run(plan, sampling)
                started = trio.current_time()
                steps = self.steps
                failure: Exception | None = None
                try:
                    if run is None:
                        sampled = await self.runner.step(plan)
                    else:
                        assert self._decoder is not None  # (runs are planned for it only)
                        self._run = run
                        feed = partial(self._commit_run, sampling)
                        await self._decoder.decode_run(plan, run, feed)
                except Exception as exc:
                    failure = exc
                finally:
                    # Before anything reacts to the failure: an abort from a consumer of it
                    # must not reach the run that has ended.
                    self._run = None
                    # A run's decodes are steps (they count one each in _commit_run).
                    decodes = max(self.steps - steps, 1)
                    elapsed = trio.current_time() - started
                    self.step_times.extend([elapsed / decodes] * min(decodes, STEP_WINDOW))
                if failure is not None:
                    self._kv.end_step(ok=False)
                    self._fail_step(plan, failure)
                    del failure  # no traceback cycle through this frame
                    continue
                self._kv.end_step(ok=True)
                if run is None:
                    self.steps += 1
                    # A verified entry commits its accepted drafts before its sampled token.
                    spec = self._spec
                    decoded = [sampled] if spec is None else spec.expand(plan, sampling, sampled)
                    self._commit(sampling, decoded, stepped)
        finally:
            self._shutdown()

    def _reap(self) -> None:
        for seq in [s for s in self.running if s.abort is not None]:
            self._finish(seq, seq.abort or abort_reason())

    def _admit(self) -> None:
        now = trio.current_time() if self.waiting else 0.0
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            seq.admitted_at = now
            if seq.max_new_tokens == 0 and not seq.scores_prompt:
                self._finish(seq, length_reason(0))
                continue
            admitted.append(seq)
            seq.slot = heapq.heappop(self._free_slots)
            params = seq.params
            if seq.hooks is not None and params.logit_bias:
                # The hooks apply the bias in SGLang's place (before a custom processor and
                # logprobs); the sampler chain must not apply it again.
                params = dataclasses.replace(params, logit_bias={})
            self.runner.open_sequence(seq.slot, params)
            if self._spec is not None:
                seq.spec = self._spec.open(seq.prompt_ids, seq.params, seq.hooks)
            self.running.append(seq)
            self._kv.reuse(seq, self.running)
        if len(admitted) > 1:
            self._planner.hold_burst(admitted)

    def _commit_run(self, sampling: list[Sequence], decodes: list[list[int]]) -> None:
        """A run's feed: commit decodes as the runner hands them over (in the scheduler's
        task). A request that ends meanwhile is released at once (the runner decodes its
        slot no further); if others wait for a slot, the run ends for them to be admitted."""
        running = len(self.running)
        self.steps += len(decodes)
        self._feeding = True
        try:
            self._commit(sampling, decodes, ())
        finally:
            self._feeding = False
        if len(self.running) < running and self.waiting and self._run is not None:
            self._run.stop()

    def _commit(
        self,
        sampling: list[Sequence],
        decodes: list[list[int]],
        stepped: Iterable[Sequence],
    ) -> None:
        """Commit the tokens of one or more decodes (oldest first; one token per sequence in
        `sampling`, -1 for none) and send each sequence's frame once they are in. The tokens
        of one sequence go through its stop checks in order: one that ends it drops the rest."""
        now = trio.current_time()
        eos = self._eos
        for seq in stepped:
            if seq.abort is None and seq.hooks is not None and seq.hooks.failure is not None:
                self._fail(seq, seq.hooks.failure)
            elif (
                seq.abort is None
                and seq.max_new_tokens == 0
                and seq.prefilled == len(seq.prompt_ids)
            ):
                self._finish(seq, length_reason(0))  # prompt scored, nothing to generate
        for sampled in decodes:
            self.generated_tokens += len(sampled) - sampled.count(-1)
            for seq, token in zip(sampling, sampled, strict=True):
                if token < 0:
                    continue  # none in this decode (a verified entry's drafts came first)
                if seq.abort is not None or seq.finished:
                    # Aborted: reaped at the next boundary; its token is dropped, and so is
                    # the logprob the runner already scored for it.
                    if seq.hooks is not None and seq.hooks.logprobs is not None:
                        seq.hooks.logprobs.drop_last_output()
                    continue
                if not seq.output_ids:
                    seq.first_token_at = now
                seq.output_ids.append(token)
                try:
                    reason = seq.check_finished(token, eos)
                except BadRequest as exc:  # the request's own stop_regex failed on its output
                    reason = abort_reason(exc.message, status_code=400, err_type="BadRequestError")
                if reason is not None:
                    self._finish(seq, reason)
        for seq in sampling:
            # Once per token of every running request: kept to the plain attribute reads.
            if (
                not seq.finished
                and seq.abort is None
                and len(seq.output_ids) - seq.emitted_ids >= seq.stream_interval
            ):
                seq.emit_frame()

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if reason["type"] == "abort" and counts_as_request(seq.rid):
            self.aborted_requests += 1
        self._release(seq)
        seq.emit_done(reason)
        self._forget(seq)

    def _fail_step(self, plan: list[SeqStep], exc: Exception) -> None:
        """A failed forward pass leaves its sequences' KV in an unknown state: fail exactly
        those (with a 500); sequences that were not in the step carry on. A sequence aborted
        while the step ran ends with its abort (a shutdown's 503, a client's plain abort):
        its client asked for that ending before the failure, and it lost no output to it."""
        error = exc if isinstance(exc, EngineError) else RunnerFailure(f"runner failed: {exc!r}")
        slots = {step.seq_id for step in plan}
        failed = [seq for seq in self.running if seq.slot in slots]
        LOGGER.error("runner step failed; failing its %d sequences", len(failed), exc_info=exc)
        for seq in failed:
            if seq.abort is not None:
                self._finish(seq, seq.abort)
            else:
                self._fail(seq, error)

    def _fail(self, seq: Sequence, error: EngineError) -> None:
        self._release(seq)
        seq.emit_error(error)
        self._forget(seq)

    def _release(self, seq: Sequence) -> None:
        self._kv.drop_restore(seq)
        if seq.leader is not None:
            seq.leader.forks.remove(seq)
            seq.leader = None
        if seq.burst:
            seq.burst.discard(seq)
        seq.burst = None
        if seq.slot is not None:
            self.runner.close_sequence(seq.slot)
            heapq.heappush(self._free_slots, seq.slot)
            self.running.remove(seq)
            seq.slot = None
        forks, seq.forks = seq.forks, []
        for fork in forks:  # its leader left before computing the prompt: prefill after all
            fork.leader = None
            self._kv.reuse(fork, self.running)

    def _forget(self, seq: Sequence) -> None:
        for callback in self._on_finish:
            callback(seq)

    def _shutdown(self) -> None:
        reason = abort_reason(
            "The engine is shutting down.", status_code=503, err_type="unavailable"
        )
        for seq in list(self.running) + list(self.waiting):
            if seq in self.waiting:
                self.waiting.remove(seq)
            self._finish(seq, reason)
