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

KV reuse (runners with `reuses_kv`): a prompt whose chunk-aligned prefix is in the prefix
cache starts with that KV restored and prefills only the rest; a prompt identical to one
still being prefilled waits for it and forks its KV and last logits instead of prefilling
(parallel samples, `n > 1`). Both give exactly the tokens prefilling would have.

A step whose sequences are all simply decoding (no prompt chunk, no logit hooks, no
min_new_tokens mask) is planned as a run (runners that `decodes_runs`): the runner decodes
again and again without coming back between decodes, until the scheduler needs a step
boundary (a request arrives while a slot is free, one is aborted, one ends while others
wait for a slot), a request reaches its length or samples a stop token, or
`max_run_decodes`. Each decode's tokens are committed as they come when some request
streams or has stop strings or regexes, else once, at the run's end: a unary request then
costs the event loop nothing per token. What is computed is what the same steps would
compute; only the scheduler's wake-ups change.

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
from collections.abc import Callable, Iterable, Iterator
from functools import partial

import trio

from .config import EngineConfig
from .detokenize import IncrementalDetokenizer
from .errors import BadRequest, EngineError, RunnerFailure
from .logits import LogitHooks
from .prefix_cache import CacheEntry, PrefixCache, PrefixHit
from .request import (
    Done,
    EngineStats,
    Error,
    FinishReason,
    Frame,
    Logprobs,
    Output,
    abort_reason,
    counts_as_request,
    length_reason,
    stop_reason,
)
from .runners.base import DecodeRun, KVRestore, KVSave, Runner, SeqStep, decodes_runs, reuses_kv
from .sampling import SamplingParams
from .stream import OutputSender

__all__ = ["Scheduler", "Sequence"]

LOGGER = logging.getLogger("tributary.engine.scheduler")


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


_NOTHING: frozenset[int] = frozenset()

#: Steps over which `Scheduler.step_times` remembers how long a step takes: enough to
#: include the last long prefill chunk of a busy engine, short enough to forget a past burst.
STEP_WINDOW = 64


class Scheduler:
    def __init__(self, runner: Runner, config: EngineConfig, *, kv_total_cells: int) -> None:
        self.runner = runner
        self.max_running = config.max_running_requests
        self.prefill_chunk = config.prefill_chunk_tokens
        self.prefill_budget = config.prefill_budget
        self.burst_tokens = config.burst_prefill_tokens
        self.kv_total_cells = kv_total_cells
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order
        # Lowest free slot first: llama.cpp splits a step into one graph per run of
        # consecutive sequence ids, so compact slots mean fewer graphs per step.
        self._free_slots = list(range(self.max_running))
        self._eos = runner.info.eos_token_ids
        self._wakeup = trio.Event()
        self._on_finish: list[Callable[[Sequence], None]] = []
        self.steps = 0
        self.generated_tokens = 0
        #: Seconds the last STEP_WINDOW steps took on the runner (failed ones included).
        self.step_times: collections.deque[float] = collections.deque(maxlen=STEP_WINDOW)
        #: Requests refused (queue full) or ended with an abort finish_reason.
        self.aborted_requests = 0
        reuse = reuses_kv(runner)
        self.prefix_cache = (
            PrefixCache(capacity_bytes=config.prefix_cache_bytes, chunk=self.prefill_chunk)
            if reuse and config.prefix_cache_mb
            else None
        )
        self._fork = reuse and config.fork_parallel_samples
        self.max_run = config.max_run_decodes if decodes_runs(runner) else 1
        #: The run the runner is decoding, if any: a change that needs a step boundary
        #: (a request arrives or is aborted) ends it after the decode that is running.
        self._run: DecodeRun | None = None
        self._feeding = False  # within _commit_run
        #: Cache entries that the step being run restores from (unpinned when it returns).
        self._step_pins: list[CacheEntry] = []
        #: Snapshots the step being run takes: (sequence, prefix length, where it lands).
        self._step_saves: list[tuple[Sequence, int, KVSave]] = []

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
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_used_cells=self.runner.kv_used_cells(),
            kv_total_cells=self.kv_total_cells,
            steps=self.steps,
            generated_tokens=self.generated_tokens,
            aborted_requests=self.aborted_requests,
            kv_cache_bytes=int(getattr(self.runner, "kv_bytes", 0)),
            prefix_cache_bytes=cache.bytes if cache is not None else 0,
            prefix_cache_entries=len(cache) if cache is not None else 0,
            prefix_cache_hits=cache.hits if cache is not None else 0,
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
                plan, sampling, stepped = self._plan()
                run = self._plan_run(plan, sampling)
                started = trio.current_time()
                steps = self.steps
                failure: Exception | None = None
                try:
                    if run is None:
                        sampled = await self.runner.step(plan)
                    else:
                        self._run = run
                        feed = partial(self._commit_run, sampling)
                        await self.runner.decode_run(plan, run, feed)  # type: ignore[attr-defined]
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
                    self._end_step(ok=False)
                    self._fail_step(plan, failure)
                    del failure  # no traceback cycle through this frame
                    continue
                self._end_step(ok=True)
                if run is None:
                    self.steps += 1
                    self._commit(sampling, [sampled], stepped)
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
            self.running.append(seq)
            self._reuse_kv(seq)
        if len(admitted) > 1 and self.burst_tokens:
            self._hold_burst(admitted)

    def _hold_burst(self, admitted: list[Sequence]) -> None:
        """Requests admitted together decode only once all of them have their first token,
        if their prompts hold at most `burst_tokens` tokens still to compute (forks compute
        none: their leader's prompt is theirs)."""
        remaining = sum(len(s.prompt_ids) - s.prefilled for s in admitted if s.leader is None)
        if remaining > self.burst_tokens:
            return
        # A fork of a leader admitted earlier waits for that leader's prefill, which the
        # limit did not count: it is no member, so nobody waits through it.
        ours = set(admitted)
        burst = {
            s for s in admitted if s.max_new_tokens > 0 and (s.leader is None or s.leader in ours)
        }
        if len(burst) > 1:
            for seq in burst:
                seq.burst = burst

    def _reuse_kv(self, seq: Sequence) -> None:
        """Before `seq` prefills: wait to fork an identical prompt still being prefilled, or
        start from the longest prefix the cache holds."""
        leader = self._fork_leader(seq)
        if leader is not None:
            seq.leader = leader
            leader.forks.append(seq)
            return
        if self.prefix_cache is None:
            return
        prompt = seq.prompt_ids
        if seq.scores_prompt:
            # Restored positions yield no logits: only a prefix before the first scored one
            # (SGLang limits its radix match the same way).
            assert seq.hooks is not None and seq.hooks.logprobs is not None
            prompt = prompt[: seq.hooks.logprobs.spec.start_len + 1]
        hit = self.prefix_cache.lookup(prompt)
        if hit is not None:
            self.prefix_cache.pin(hit.entry)
            seq.pending_restore = hit
            seq.prefilled = seq.cached_tokens = hit.n_tokens

    def _fork_leader(self, seq: Sequence) -> Sequence | None:
        """A running sequence with the same prompt that has not computed its last chunk yet,
        if `seq` can take a copy of its KV and last logits (it needs no prompt logprobs of
        its own, and both sample a token after the prompt)."""
        if not self._fork or seq.scores_prompt or seq.max_new_tokens == 0:
            return None
        prompt = seq.prompt_ids
        for other in self.running:
            if (
                other is not seq
                and other.leader is None
                and other.abort is None
                and other.max_new_tokens > 0
                and other.prefilled < len(other.prompt_ids)
                and other.prompt_ids == prompt
            ):
                return other
        return None

    def _plan(self) -> tuple[list[SeqStep], list[Sequence], list[Sequence]]:
        """The step's entries; the sequences that get a token, in plan order; and every
        sequence in the step."""
        plan: list[SeqStep] = []
        sampling: list[Sequence] = []
        stepped: list[Sequence] = []
        budget = self.prefill_budget
        forked: list[Sequence] = []
        first_tokens: list[tuple[int, Sequence]] = []  # (plan index, sequence)
        for seq in self.running:
            assert seq.slot is not None
            if seq.leader is not None:
                continue  # planned with its leader's last chunk
            prompt_len = len(seq.prompt_ids)
            if seq.prefilled == prompt_len:  # decoding
                if seq.burst is not None:
                    if seq.burst:
                        continue  # held until the rest of its burst has a first token
                    seq.burst = None
                output_ids = seq.output_ids
                pos = prompt_len + len(output_ids) - 1
                suppress = self._suppress(seq)
                plan.append(SeqStep(seq.slot, [output_ids[-1]], pos, True, suppress, seq.hooks))
                sampling.append(seq)
                stepped.append(seq)
                continue
            # Chunks are cut at fixed multiples of prefill_chunk from the prompt's start,
            # never by what budget is left, so a prompt is computed in the same pieces
            # whatever else runs (the first prefilling sequence always fits).
            start = seq.prefilled
            end = min(prompt_len, (start // self.prefill_chunk + 1) * self.prefill_chunk)
            if end - start > budget:
                continue
            done = end == prompt_len
            sample = done and seq.max_new_tokens > 0
            targets, offset = self._prompt_targets(seq, start, end)
            plan.append(
                SeqStep(
                    seq.slot,
                    seq.prompt_ids[start:end],
                    start,
                    sample,
                    self._suppress(seq),
                    seq.hooks,
                    targets,
                    offset,
                    restore=self._plan_restore(seq),
                    save=self._plan_save(seq, end),
                )
            )
            seq.prefilled = end
            budget -= end - start
            stepped.append(seq)
            if done and seq.burst:
                seq.burst.discard(seq)
            if sample:
                first_tokens.append((len(plan) - 1, seq))
                sampling.append(seq)
                for fork in seq.forks:  # each samples from this chunk's logits, then decodes
                    assert fork.slot is not None
                    plan.append(
                        SeqStep(
                            fork.slot,
                            [],
                            prompt_len,
                            True,
                            self._suppress(fork),
                            fork.hooks,
                            fork_from=seq.slot,
                        )
                    )
                    fork.prefilled = fork.cached_tokens = prompt_len
                    if fork.burst:
                        fork.burst.discard(fork)
                    first_tokens.append((len(plan) - 1, fork))
                    stepped.append(fork)
                    sampling.append(fork)
                    forked.append(fork)
                seq.forks = []
        for fork in forked:  # (set only now: the loop above must skip them)
            fork.leader = None
        for i, seq in first_tokens:
            # A first token whose burst is still prefilling after this step is not decoded
            # next step: the runner must not decode it ahead either.
            if seq.burst:
                plan[i] = dataclasses.replace(plan[i], decode_ahead=False)
        return plan, sampling, stepped

    def _plan_run(self, plan: list[SeqStep], sampling: list[Sequence]) -> DecodeRun | None:
        """A run for this plan if every entry is a plain decode; None for a single step.
        (Requests still waiting here wait for a slot: the run ends when one frees.)"""
        if self.max_run < 2 or len(plan) != len(sampling):
            return None
        limit = self.max_run
        watched = False
        stop_ids: list[frozenset[int]] = []
        for entry, seq in zip(plan, sampling, strict=True):
            if (
                entry.hooks is not None
                or entry.suppress
                or not seq.output_ids  # a prompt's one-token last chunk, not a decode
                or seq.abort is not None
            ):
                return None
            # Each of its tokens up to its length is an ordinary token (length comes first).
            limit = min(limit, seq.max_new_tokens - len(seq.output_ids))
            watched = watched or seq.watched
            params = seq.params
            stop_ids.append(_NOTHING if params.ignore_eos else self._eos | params.stop_token_ids)
        if limit < 2:
            return None
        return DecodeRun(limit=limit, stop_ids=stop_ids, wake_each=watched)

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

    def _plan_restore(self, seq: Sequence) -> KVRestore | None:
        hit, seq.pending_restore = seq.pending_restore, None
        if hit is None:
            return None
        self._step_pins.append(hit.entry)  # the step now holds the pin
        return KVRestore(hit.entry.state, hit.n_tokens)

    def _plan_save(self, seq: Sequence, end: int) -> KVSave | None:
        """Snapshot a prompt once, at its last chunk boundary: one entry serves every shorter
        chunk-aligned prefix too, and a snapshot costs a copy of the whole prefix's KV (so
        none at the boundaries before, and none if the cache already holds it)."""
        cache = self.prefix_cache
        if cache is None or end != len(seq.prompt_ids) // self.prefill_chunk * self.prefill_chunk:
            return None
        if end <= seq.cached_tokens or cache.holds(seq.prompt_ids[:end]):
            return None
        save = KVSave()
        self._step_saves.append((seq, end, save))
        return save

    def _end_step(self, *, ok: bool) -> None:
        """Release the step's pins; keep its snapshots if it succeeded (also those of
        sequences aborted meanwhile: their KV was computed all the same)."""
        cache = self.prefix_cache
        pins, self._step_pins = self._step_pins, []
        saves, self._step_saves = self._step_saves, []
        if cache is None:
            return
        for entry in pins:
            cache.unpin(entry)
        for seq, end, save in saves if ok else ():
            if save.state is not None:
                cache.insert(seq.prompt_ids[:end], save.state)

    @staticmethod
    def _prompt_targets(seq: Sequence, start: int, end: int) -> tuple[list[int] | None, int]:
        """Prompt logprobs for a chunk [start, end): the logits at position j score prompt
        token j + 1, for the positions from the request's logprob_start_len on (its first
        position has no logprob) up to the prompt's second-to-last (the last one's logits
        sample the first output token)."""
        if not seq.scores_prompt:
            return None, 0
        assert seq.hooks is not None and seq.hooks.logprobs is not None
        first = max(start, seq.hooks.logprobs.spec.start_len)
        last = min(end, len(seq.prompt_ids) - 1)  # exclusive
        if first >= last:
            return None, 0
        return seq.prompt_ids[first + 1 : last + 1], first - start

    def _commit(
        self,
        sampling: list[Sequence],
        decodes: list[list[int]],
        stepped: Iterable[Sequence],
    ) -> None:
        """Commit the tokens of one or more decodes (oldest first; one token per sequence in
        `sampling`, -1 for none) and send each sequence's frame once they are in."""
        now = trio.current_time()
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
                    reason = self._check_finished(seq, token)
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

    def _check_finished(self, seq: Sequence, token: int) -> FinishReason | None:
        """SGLang's order: the length limit first (a token that reaches it is ordinary text,
        even an EOS or the end of a stop string); then stop tokens; then stop strings.

        `min_new_tokens`: the first min_new_tokens tokens can be neither a stop token (they
        are masked when sampling, `_suppress`) nor the end of a stop string.
        """
        params = seq.params
        n = len(seq.output_ids)
        if n >= seq.max_new_tokens:
            seq.detok.add(token, check_stops=False, last=True)
            return length_reason(n if params.max_new_tokens is None else params.max_new_tokens)
        may_stop = n > params.min_new_tokens
        is_stop_token = not params.ignore_eos and (
            token in self._eos or token in params.stop_token_ids
        )
        if is_stop_token and may_stop:
            return stop_reason(token)  # counted in output_ids, never rendered into text
        matched = seq.detok.add(token, check_stops=may_stop)
        if matched is not None:
            return stop_reason(matched)
        grammar = seq.hooks.grammar if seq.hooks is not None else None
        if grammar is not None and grammar.finished:
            return stop_reason(token)  # SGLang: a grammar that ends stops on its last token
        return None

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
        hit, seq.pending_restore = seq.pending_restore, None
        if hit is not None and self.prefix_cache is not None:
            self.prefix_cache.unpin(hit.entry)
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
            self._reuse_kv(fork)

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

    def _suppress(self, seq: Sequence) -> frozenset[int]:
        """Before min_new_tokens, EOS and stop tokens may not be sampled (as SGLang's
        min-new-tokens penalizer does)."""
        params = seq.params
        if params.ignore_eos or len(seq.output_ids) >= params.min_new_tokens:
            return _NOTHING
        return self._eos | params.stop_token_ids

    def all_sequences(self) -> Iterator[Sequence]:
        yield from self.running
        yield from self.waiting
