"""Prompt prefixes' KV, kept in host memory so a later prompt that starts the same way skips
their prefill (llama-server's `--cache-ram`, in the engine's own terms).

Synopsis::

    cache = PrefixCache(capacity_bytes=1 << 30, chunk=256)
    hit = cache.lookup(prompt_ids)            # longest cached chunk-aligned prefix, or None
    if hit is not None:
        cache.pin(hit.entry)                  # not evicted until the restore has run
        ... SeqStep(restore=KVRestore(hit.entry.state, hit.n_tokens)) ...
        cache.unpin(hit.entry)
    cache.insert(prompt_ids[:end], state)     # after a chunk boundary was computed

Prefixes are cut only at multiples of `chunk` (the scheduler's prefill chunk), so a restored
prefix is exactly the KV that prefilling would have computed in the same pieces: a cache hit
never changes greedy output (docs/architecture.md, "Prefix cache").

One entry serves every chunk-aligned prefix of its tokens: KV at a position depends only on
the tokens before it, so the runner restores the entry and drops the positions past the
match. An entry whose tokens are a prefix of a new one's is therefore redundant and leaves
when the new one comes in. Entries are evicted least recently used first, never while
pinned; an entry that does not fit beside the pinned ones is not stored. The bound counts
the snapshots' bytes (`KVState.nbytes`), the memory that matters (about 23 KB a token for
SmolLM2 at f16).

A model with sliding-window attention (Gemma 3: `window` = 512 positions) breaks the "every
prefix" rule: llama.cpp's snapshot of a sequence keeps only the last `window` positions of
its sliding-window layers, so dropping positions past a match leaves the next token without
part of its window. There an entry serves only its own length, or every prefix if it is no
longer than the window, and so a longer entry does not replace a shorter one it contains.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from array import array
from collections.abc import Iterator, Sequence

from .runners.base import KVState

__all__ = ["CacheEntry", "PrefixCache", "PrefixHit"]


@dataclasses.dataclass(eq=False)
class CacheEntry:
    key: bytes  # the hash of all its tokens
    tokens: tuple[int, ...]  # chunk-aligned: len(tokens) is a multiple of the chunk
    state: KVState
    #: Scheduler-planned restores not yet run; a pinned entry is never evicted.
    pins: int = 0

    @property
    def nbytes(self) -> int:
        return self.state.nbytes


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    entry: CacheEntry
    n_tokens: int  # how many of the prompt's first tokens the entry holds (chunk-aligned)


class PrefixCache:
    """An LRU of prefix KV snapshots bounded in bytes. Used by the scheduler task only."""

    def __init__(self, *, capacity_bytes: int, chunk: int, window: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.chunk = chunk
        #: The model's attention window (positions), or None: every entry serves every
        #: chunk-aligned prefix of its tokens.
        self.window = window
        #: Least recently used first; keyed by the hash of all of an entry's tokens.
        self._entries: collections.OrderedDict[bytes, CacheEntry] = collections.OrderedDict()
        #: The hash of every chunk-aligned prefix -> the entries that hold it.
        self._holders: dict[bytes, list[bytes]] = {}
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

    def lookup(self, tokens: Sequence[int]) -> PrefixHit | None:
        """The longest cached prefix of `tokens` that is a multiple of the chunk and leaves
        at least one token to compute (the logits to sample from). Marks it recently used."""
        best: PrefixHit | None = None
        for end, digest in self._prefix_hashes(tokens, limit=len(tokens) - 1):
            holders = self._holders.get(digest)
            if not holders:
                break  # a longer prefix cannot be held if this one is not
            holder = self._server(holders, end)
            if holder is not None:
                best = PrefixHit(holder, end)
        if best is None or best.entry.tokens[: best.n_tokens] != tuple(tokens[: best.n_tokens]):
            return None  # (the second test: a hash collision, never trusted)
        self._touch(best.entry)
        self.hits += 1
        return best

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether some entry already holds all of `tokens` (chunk-aligned)."""
        hashes = list(self._prefix_hashes(tokens, limit=len(tokens)))
        if not hashes or hashes[-1][0] != len(tokens):
            return False
        holders = self._holders.get(hashes[-1][1])
        return holders is not None and self._server(holders, len(tokens)) is not None

    def insert(self, tokens: Sequence[int], state: KVState) -> bool:
        """Keep `state`, the KV of `tokens` (a multiple of the chunk long). Evicts least
        recently used unpinned entries to stay within the bound; returns False (and keeps
        nothing) if it cannot fit. Entries that hold only a prefix of `tokens` leave."""
        if not tokens or len(tokens) % self.chunk or state.nbytes > self.capacity_bytes:
            return False
        hashes = [digest for _end, digest in self._prefix_hashes(tokens, limit=len(tokens))]
        key = hashes[-1]
        holder = self._server(self._holders.get(key, []), len(tokens))
        if holder is not None:  # already held, maybe by a longer entry
            self._touch(holder)
            return False
        # Decide first whether it can fit at all: a refused entry must not cost the cache the
        # entries it would have evicted or replaced.
        pinned = sum(e.nbytes for e in self._entries.values() if e.pins)
        if pinned + state.nbytes > self.capacity_bytes:
            return False
        for digest in hashes[:-1] if self._serves_prefixes(len(tokens)) else ():
            shorter = self._entries.get(digest)
            if shorter is not None and not shorter.pins:
                self._remove(digest)
        while self.bytes + state.nbytes > self.capacity_bytes:
            victim = next((k for k, e in self._entries.items() if not e.pins), None)
            if victim is None:
                return False
            self._remove(victim)
            self.evictions += 1
        self._entries[key] = CacheEntry(key, tuple(tokens), state)
        self.bytes += state.nbytes
        for digest in hashes:
            self._holders.setdefault(digest, []).append(key)
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

    def _serves_prefixes(self, length: int) -> bool:
        """Whether an entry of `length` tokens serves its shorter prefixes too."""
        return self.window is None or length <= self.window

    def _server(self, holders: list[bytes], end: int) -> CacheEntry | None:
        """The most recently inserted of `holders` that can serve the prefix of `end` tokens."""
        for key in reversed(holders):
            entry = self._entries[key]
            if len(entry.tokens) == end or self._serves_prefixes(len(entry.tokens)):
                return entry
        return None

    def _touch(self, entry: CacheEntry) -> None:
        self._entries.move_to_end(entry.key)

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes
        for _end, digest in self._prefix_hashes(entry.tokens, limit=len(entry.tokens)):
            holders = self._holders[digest]
            holders.remove(key)
            if not holders:
                del self._holders[digest]

    def _prefix_hashes(self, tokens: Sequence[int], *, limit: int) -> Iterator[tuple[int, bytes]]:
        """(end, hash of tokens[:end]) for end = chunk, 2 * chunk, ... <= limit; each hash
        chains the previous one, so a prompt is hashed once whatever its length."""
        digest = b""
        for end in range(self.chunk, limit + 1, self.chunk):
            piece = array("i", tokens[end - self.chunk : end]).tobytes()
            digest = hashlib.blake2b(digest + piece, digest_size=16).digest()
            yield end, digest
