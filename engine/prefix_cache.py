"""Prompts' KV, kept in host memory so a later prompt that starts the same way skips their
prefill (llama-server's `--cache-ram` and slot reuse, SGLang's radix cache, in the engine's
own terms).

Synopsis::

    cache = PrefixCache(capacity_bytes=1 << 30, chunk=256, mode="exact")
    hit = cache.lookup(prompt_ids, whole=True)  # the longest usable cached prefix, or None
    if hit is not None:
        cache.pin(hit.entry)                    # not evicted until the restore has run
        ... SeqStep(restore=KVRestore(hit.entry.state, hit.n_tokens, logits)) ...
        cache.unpin(hit.entry)
    cache.insert(prompt_ids, state, logits)     # after the prompt (or a prefix) was computed

An entry is the KV of some tokens and, when it is a whole prompt whose last position was
sampled from, that position's logits row as the decode left it. It serves:

- the whole prompt it holds (`lookup(..., whole=True)`), with its logits: nothing is
  computed, and the first token is sampled from the saved row, exactly as after a cold
  prefill (the same KV bits, the same row);
- a prefix of it, which the runner restores by dropping the positions past the match (KV at
  a position depends only on the tokens before it). Mode "exact" cuts prefixes only at
  multiples of `chunk` (the scheduler's prefill chunk), so the rest is computed in the same
  pieces as a cold prefill and greedy output never changes; mode "any" takes the longest
  common prefix at any token, as llama-server and SGLang do, and the rest is then computed
  in other pieces (docs/benchmarks/prefix-reuse.md measures how often that changes output).
  A prefix always leaves at least one token to compute, for the logits to sample from.

Lookup: entries are kept sorted by their packed tokens, so the entry sharing the longest
prefix with a prompt is one of the prompt's two neighbours in that order (one `bisect` and
two comparisons, all memcmp: 0.25 ms for an 8k-token prompt among 500 entries of 8k tokens,
most of it packing the prompt's ids; an insert, 0.6-1 ms).
An entry without logits whose tokens are a prefix of a new one's is redundant and leaves;
one with logits stays (it also serves its whole prompt). Entries are evicted least recently
used first, never while pinned; an entry that does not fit beside the pinned ones is not
stored. The bound counts the snapshots' bytes and the logits rows (a row is the vocabulary
in float32: 192 KiB for SmolLM2, whose KV is about 23 KB a token at f16).

A model with sliding-window attention (Gemma 3: `window` = 512 positions) breaks the "every
prefix" rule: llama.cpp's snapshot of a sequence keeps only the last `window` positions of
its sliding-window layers, so dropping positions past a match leaves the next token without
part of its window. There an entry serves only its own length, or every prefix if it is no
longer than the window, and so a longer entry does not replace a shorter one it contains.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import struct
from array import array
from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np

from .runners.base import KVState

__all__ = ["CacheEntry", "PrefixCache", "PrefixHit", "PrefixReuse"]

#: "exact": prefixes cut at chunk boundaries, and whole prompts; "any": at any token too.
PrefixReuse = Literal["exact", "any"]

_ITEM = 4  # bytes a packed token takes


def pack(tokens: Sequence[int]) -> bytes:
    """Token ids as an entry's key: 4 bytes each, so that comparing keys is a memcmp.
    (`struct.pack` takes half the time `array` does: 0.3 ms for 8k ids.)"""
    return struct.pack(f"{len(tokens)}i", *tokens)


@dataclasses.dataclass(eq=False)
class CacheEntry:
    key: bytes  # its tokens, packed
    state: KVState
    #: The logits row after its last position, before any suppression, hook or sampler
    #: touched it; None for a prefix, or a prompt that sampled nothing.
    logits: np.ndarray | None = None
    #: Scheduler-planned restores not yet run; a pinned entry is never evicted.
    pins: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.key) // _ITEM

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(array("i", self.key))

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + (0 if self.logits is None else int(self.logits.nbytes))


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    entry: CacheEntry
    n_tokens: int  # how many of the prompt's first tokens the entry holds
    #: All of the prompt: nothing to compute, the first token comes from `entry.logits`
    #: (None when the prompt samples nothing).
    whole: bool = False


class PrefixCache:
    """An LRU of prompt KV snapshots bounded in bytes. Used by the scheduler task only."""

    def __init__(
        self,
        *,
        capacity_bytes: int,
        chunk: int,
        window: int | None = None,
        mode: PrefixReuse = "exact",
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.chunk = chunk
        #: The model's attention window (positions), or None: every entry serves every
        #: prefix of its tokens.
        self.window = window
        self.mode: PrefixReuse = mode
        #: Least recently used first; keyed by packed tokens.
        self._entries: collections.OrderedDict[bytes, CacheEntry] = collections.OrderedDict()
        #: The keys of entries that serve their prefixes, sorted; and of those that serve
        #: only their own length (sliding window).
        self._sorted: list[bytes] = []
        self._own_length: set[bytes] = set()
        self.bytes = 0
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[CacheEntry]:
        """Entries, least recently used first."""
        return iter(list(self._entries.values()))

    @property
    def pins(self) -> int:
        return sum(e.pins for e in self._entries.values())

    def lookup(
        self, tokens: Sequence[int], *, whole: bool = False, logits: bool = True
    ) -> PrefixHit | None:
        """The entry that holds the longest usable prefix of `tokens`: all of them if
        `whole` and an entry holds exactly these (with a logits row if `logits`: the first
        token is to be sampled from it); else the longest prefix the mode allows that
        leaves at least one token to compute. Marks it recently used."""
        key = pack(tokens)
        entry = self._entries.get(key) if whole else None
        if entry is not None and (entry.logits is not None or not logits):
            return self._hit(PrefixHit(entry, len(tokens), whole=True))
        limit = len(tokens) - 1
        best: CacheEntry | None = None
        length = 0
        # The longest common prefix with a sorted set is with one of the two neighbours.
        at = bisect.bisect_left(self._sorted, key)
        for other in self._sorted[max(at - 1, 0) : at + 1]:
            n = self._usable(min(common_prefix(key, other), limit))
            if n > length:
                best, length = self._entries[other], n
        for other in self._own_length:  # (sliding window: only a whole entry restores)
            n = len(other) // _ITEM
            if length < n <= limit and self._usable(n) == n and key.startswith(other):
                best, length = self._entries[other], n
        return None if best is None else self._hit(PrefixHit(best, length))

    def holds(self, tokens: Sequence[int], *, logits: bool = False) -> bool:
        """Whether some entry already serves all of `tokens` (with their last logits row, if
        `logits`)."""
        key = pack(tokens)
        entry = self._entries.get(key)
        if entry is not None:
            return entry.logits is not None or not logits
        return not logits and self._container(key) is not None

    def insert(
        self, tokens: Sequence[int], state: KVState, logits: np.ndarray | None = None
    ) -> bool:
        """Keep `state`, the KV of `tokens`, and `logits`, the row after their last position
        (None: a prefix only). Evicts least recently used unpinned entries to stay within
        the bound; returns False (and keeps nothing) if it is already served or cannot fit.
        Entries without logits that hold only a prefix of `tokens` leave."""
        key = pack(tokens)
        nbytes = state.nbytes + (0 if logits is None else int(logits.nbytes))
        if not tokens or nbytes > self.capacity_bytes:
            return False
        same = self._entries.get(key)
        holder = same if same is not None else None if logits is not None else self._container(key)
        if holder is not None and (holder.logits is not None or logits is None or holder.pins):
            self._touch(holder)  # already served (or in use: not replaced under a restore)
            return False
        # Decide first whether it can fit at all: a refused entry must not cost the cache the
        # entries it would have evicted or replaced.
        pinned = sum(e.nbytes for e in self._entries.values() if e.pins)
        if pinned + nbytes > self.capacity_bytes:
            return False
        if same is not None:
            self._remove(key)  # the same tokens without their logits: replaced
        if self._serves_prefixes(len(tokens)):
            for other in self._sorted[: bisect.bisect_left(self._sorted, key)]:
                shorter = self._entries[other]
                if key.startswith(other) and shorter.logits is None and not shorter.pins:
                    self._remove(other)
        while self.bytes + nbytes > self.capacity_bytes:
            victim = next((k for k, e in self._entries.items() if not e.pins), None)
            if victim is None:
                return False
            self._remove(victim)
            self.evictions += 1
        self._entries[key] = CacheEntry(key, state, logits)
        self.bytes += nbytes
        if self._serves_prefixes(len(tokens)):
            bisect.insort(self._sorted, key)
        else:
            self._own_length.add(key)
        return True

    def pin(self, entry: CacheEntry) -> None:
        entry.pins += 1

    def unpin(self, entry: CacheEntry) -> None:
        assert entry.pins > 0
        entry.pins -= 1

    def clear(self) -> int:
        """Drop every unpinned entry (the scheduler flushes only when nothing runs, so that is
        all of them); returns how many left."""
        victims = [k for k, e in self._entries.items() if not e.pins]
        for key in victims:
            self._remove(key)
        return len(victims)

    def serves_prefixes(self, length: int) -> bool:
        """Whether an entry of `length` tokens serves its shorter prefixes too."""
        return self._serves_prefixes(length)

    def _serves_prefixes(self, length: int) -> bool:
        return self.window is None or length <= self.window

    def _usable(self, n: int) -> int:
        """The longest prefix of `n` shared tokens this mode restores."""
        return n if self.mode == "any" else n - n % self.chunk

    def _container(self, key: bytes) -> CacheEntry | None:
        """An entry that serves its prefixes and holds all of `key`'s tokens, if any: the
        first entry at or after `key` in sorted order, if any does."""
        at = bisect.bisect_left(self._sorted, key)
        if at < len(self._sorted) and self._sorted[at].startswith(key):
            return self._entries[self._sorted[at]]
        return None

    def _hit(self, hit: PrefixHit) -> PrefixHit:
        self._touch(hit.entry)
        self.hits += 1
        return hit

    def _touch(self, entry: CacheEntry) -> None:
        self._entries.move_to_end(entry.key)

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes
        if key in self._own_length:
            self._own_length.remove(key)
        else:
            del self._sorted[bisect.bisect_left(self._sorted, key)]


def common_prefix(a: bytes, b: bytes) -> int:
    """How many tokens two packed token sequences share from the start."""
    n = min(len(a), len(b)) // _ITEM
    if a[: n * _ITEM] == b[: n * _ITEM]:  # (a memcmp: the usual case for a held prefix)
        return n
    x = np.frombuffer(a, dtype=np.int32, count=n)
    y = np.frombuffer(b, dtype=np.int32, count=n)
    return int(np.argmax(x != y))
