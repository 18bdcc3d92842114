"""KV reuse, for runners that `ReusesKV`: the prefix cache, and forks of parallel samples.

A prompt the prefix cache holds whole starts with all of its KV restored and samples its
first token from the saved logits row, computing nothing; one whose prefix is in the cache
(cut at a chunk boundary, or at any token with `prefix_reuse="any"`) starts with that KV
restored and prefills only the rest; a prompt identical to one still being prefilled waits
for it and forks its KV and last logits instead of prefilling (parallel samples, `n > 1`).
All but the mid-chunk prefixes of "any" give exactly the tokens prefilling would have.

`KVReuse` decides which when a sequence is admitted (`reuse`), gives the step planner each
prompt chunk's restore and snapshot (`plan_restore`, `plan_save`), and when the step has
returned unpins what it restored from and keeps what it saved (`end_step`). All of it runs
in the scheduler's task.
"""

from __future__ import annotations

from ..config import EngineConfig
from ..prefix_cache import CacheEntry, PrefixCache
from ..runners.base import KVRestore, KVSave, ReusesKV, Runner
from .sequence import Sequence

__all__ = ["KVReuse"]


class KVReuse:
    """The prefix cache and fork policy of one scheduler (both off for a runner that does
    not reuse KV: every prompt is then prefilled, as before)."""

    def __init__(self, runner: Runner, config: EngineConfig) -> None:
        reuse = isinstance(runner, ReusesKV) and runner.reuses_kv
        self.prefill_chunk = config.prefill_chunk_tokens
        self.prefix_cache = (
            PrefixCache(
                capacity_bytes=config.prefix_cache_bytes,
                chunk=self.prefill_chunk,
                # A sliding-window model's snapshots keep only the window (prefix_cache.py).
                window=getattr(runner, "kv_window", None),
                mode=config.prefix_reuse,
            )
            if reuse and config.prefix_cache_mb
            else None
        )
        self._fork = reuse and config.fork_parallel_samples
        #: Cache entries that the step being run restores from (unpinned when it returns).
        self._step_pins: list[CacheEntry] = []
        #: Snapshots the step being run takes: (sequence, prefix length, where it lands).
        self._step_saves: list[tuple[Sequence, int, KVSave]] = []

    def reuse(self, seq: Sequence, running: list[Sequence]) -> None:
        """Before `seq` prefills: wait to fork an identical prompt still being prefilled, or
        start from the whole prompt or the longest prefix the cache holds."""
        leader = self._fork_leader(seq, running)
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
        hit = self.prefix_cache.lookup(
            prompt, whole=not seq.scores_prompt, logits=seq.max_new_tokens > 0
        )
        if hit is not None:
            self.prefix_cache.pin(hit.entry)
            seq.pending_restore = hit
            seq.prefilled = seq.cached_tokens = hit.n_tokens

    def _fork_leader(self, seq: Sequence, running: list[Sequence]) -> Sequence | None:
        """A running sequence with the same prompt that has not computed its last chunk yet,
        if `seq` can take a copy of its KV and last logits (it needs no prompt logprobs of
        its own, and both sample a token after the prompt)."""
        if not self._fork or seq.scores_prompt or seq.max_new_tokens == 0:
            return None
        prompt = seq.prompt_ids
        for other in running:
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

    def plan_restore(self, seq: Sequence) -> KVRestore | None:
        hit, seq.pending_restore = seq.pending_restore, None
        if hit is None:
            return None
        self._step_pins.append(hit.entry)  # the step now holds the pin
        logits = hit.entry.logits if hit.whole and seq.max_new_tokens > 0 else None
        return KVRestore(hit.entry.state, hit.n_tokens, logits)

    def plan_save(self, seq: Sequence, end: int) -> KVSave | None:
        """Snapshot a prompt once, when its last chunk is computed, with the logits row its
        first token is sampled from: it serves the whole prompt and every shorter prefix (a
        snapshot costs a copy of the whole prefix's KV: none at the boundaries before, and
        none if the cache already holds it). The row is kept only when it is what a cold
        prefill gives: not beside the rows of prompt logprobs (another output shape). With a
        sliding window a long prompt's snapshot serves only itself, so its last chunk
        boundary is saved too, as a prefix."""
        cache = self.prefix_cache
        prompt = seq.prompt_ids
        if cache is None or end <= seq.cached_tokens:
            return None
        if end == len(prompt):
            with_logits = seq.max_new_tokens > 0 and not seq.scores_prompt
            if cache.holds(prompt, logits=with_logits):
                return None
            save = KVSave(with_logits=with_logits)
        elif (
            end == len(prompt) // self.prefill_chunk * self.prefill_chunk
            and not cache.serves_prefixes(len(prompt))
            and not cache.holds(prompt[:end])
        ):
            save = KVSave()
        else:
            return None
        self._step_saves.append((seq, end, save))
        return save

    def end_step(self, *, ok: bool) -> None:
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
                cache.insert(seq.prompt_ids[:end], save.state, save.logits)

    def drop_restore(self, seq: Sequence) -> None:
        """`seq` ends before the step that was to restore its prefix: unpin that entry."""
        hit, seq.pending_restore = seq.pending_restore, None
        if hit is not None and self.prefix_cache is not None:
            self.prefix_cache.unpin(hit.entry)
