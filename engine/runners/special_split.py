"""Tokenize text with many special tokens in linear time, with llama.cpp's own answer.

llama.cpp splits a text at its special tokens (`tokenizer_st_partition`, src/llama-vocab.cpp)
before running the model's tokenizer on the pieces between them. The split keeps the pieces
in a `std::forward_list` and, for every occurrence it cuts out, walks the list from its head
to the fragment being cut (`std::distance(buffer.begin(), it)`, then `std::next(...)` to erase
it), so a text with k occurrences costs O(k²): measured on SmolLM2, 8,000 `<|im_start|>` took
0.76 s and 30,000 took 12.3 s, against 0.09 s for 420 KB of plain text.

`cut_points` finds places where the text can be cut so that tokenizing the pieces one by one
and joining the ids gives exactly the whole text's ids, at most every `every` special-token
occurrences; each piece then costs llama.cpp O(every²) and the whole text O(k · every).

Why a cut is exact. A cut goes right after an occurrence [s, e) of a special token t that no
other occurrence of any special token overlaps (including t's own, and the whitespace t's
`rstrip` attribute eats after it), and whose first and last bytes are not whitespace:

- whatever order llama.cpp takes the special tokens in, no earlier match can touch [s, e)
  (none overlaps it) and no whitespace stripping can reach into it (stripping stops at the
  first non-whitespace byte), so when t's turn comes the occurrence lies inside one raw
  fragment and t's leftmost-first scan matches it: e is a fragment boundary of the whole
  text's split, followed by a fragment that starts after the whitespace `rstrip` removes;
- every other token's scan finds the same occurrences in the two pieces as in the whole
  text, because none straddles the cut;
- the model's tokenizer runs on each raw fragment on its own, so the whole text's ids are the
  pieces' ids joined. For SentencePiece vocabularies the space llama.cpp puts before a
  fragment that follows a special token is also put before a piece's first fragment (it
  starts "after a special token"). BOS is added to the first piece only; a vocabulary that
  adds EOS is tokenized whole when special tokens are added (the caller's choice).

`tests/engine/test_special_split.py` checks the joined ids against llama.cpp's whole-text
answer on randomized mixtures of special tokens, whitespace and text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

__all__ = ["SpecialToken", "SpecialTokens", "cut_points"]

#: What C's isspace() calls whitespace in the "C" locale (llama.cpp's lstrip/rstrip test).
_WHITESPACE = frozenset(b" \t\n\v\f\r")

#: Special-token occurrences per piece: llama.cpp's split then costs about every² per piece.
EVERY = 64


@dataclasses.dataclass(frozen=True)
class SpecialToken:
    text: bytes
    lstrip: bool = False
    rstrip: bool = False


class SpecialTokens:
    """The special tokens llama.cpp cuts a text at (CONTROL, USER_DEFINED and UNKNOWN
    tokens, as its `cache_special_tokens`), with their strip attributes.

    Built once per model: for each token, the other tokens (and itself) whose occurrences
    can overlap one of its own (`_overlaps`), so that checking a cut looks only at those,
    whatever the size of the vocabulary: Gemma-sized vocabularies have thousands of special
    tokens, and checking every one at every candidate cut made `cut_points` cost seconds a
    megabyte."""

    def __init__(self, tokens: Iterable[SpecialToken]) -> None:
        self.tokens = [t for t in tokens if t.text]
        self.by_text = {t.text: t for t in self.tokens}
        ordered = sorted(self.by_text, key=len, reverse=True)
        self.pattern = _longest_match(ordered)
        overlaps = _overlaps(ordered)
        spaced = [t for t in ordered if t[0] in _WHITESPACE]
        #: For each token that a cut may follow, what can overlap an occurrence of it or
        #: the whitespace its rstrip eats: the tokens to look for around a candidate cut.
        #: Tokens that begin or end with whitespace, or with more than `_MAX_NEIGHBOURS`
        #: such tokens, are never cut after.
        self._neighbours: dict[bytes, tuple[bytes, ...]] = {}
        for text, token in self.by_text.items():
            if text[0] in _WHITESPACE or text[-1] in _WHITESPACE:
                continue
            near = overlaps.get(text, set())
            if token.rstrip:
                near = near | set(spaced)
            if len(near) <= _MAX_NEIGHBOURS:
                self._neighbours[text] = tuple(near)
        # Counting needs occurrences that nothing can overlap, and that no strip can eat.
        countable = [
            t
            for t in ordered
            if t not in overlaps and t[0] not in _WHITESPACE and t[-1] not in _WHITESPACE
        ]
        self._count = _longest_match(countable)
        #: The characters special tokens begin with, for weighing a text's tokenizing
        #: (`offload.work`); None when there are too many to count cheaply.
        self.marks: str | None = _first_characters(ordered)

    def count(self, data: bytes) -> int:
        """A lower bound on the special-token ids llama.cpp gives for `data`, in linear time:
        every occurrence of a special token that no other occurrence of any special token
        (nor its own) can overlap, and that does not start or end with whitespace (which a
        strip attribute could eat), is matched as that token."""
        pattern = self._count
        return 0 if pattern is None else sum(1 for _ in pattern.finditer(data))

    def _clean(self, data: bytes, start: int, token: SpecialToken) -> int | None:
        """Where the piece after the occurrence of `token` at `start` begins, if a cut after
        it is exact (no other occurrence overlaps it or the whitespace its rstrip eats, and its
        text does not begin or end with whitespace); None otherwise. Looks only for the
        tokens that can overlap `token` (a few, precomputed), in a window around it."""
        text = token.text
        near = self._neighbours.get(text)
        if near is None:
            return None
        end = start + len(text)
        resume = end
        if token.rstrip:
            match = _SPACES.match(data, end)
            assert match is not None  # `*` always matches
            resume = match.end()
        for other in near:
            size = len(other)
            # An occurrence [a, a + size) overlaps [start, resume) iff start - size < a < resume.
            lo = max(0, start - size + 1)
            hi = min(len(data), resume + size - 1)
            found = data.find(other, lo, hi)
            while found != -1:
                if not (found == start and other == text):
                    return None
                found = data.find(other, found + 1, hi)
        return resume


_SPACES = re.compile(b"[ \t\n\v\f\r]*")

#: Tokens that can overlap one token past which a cut is not worth checking after it.
_MAX_NEIGHBOURS = 32

#: Distinct first characters past which `SpecialTokens.marks` is None.
_MAX_MARKS = 32


def _overlaps(texts: list[bytes]) -> dict[bytes, set[bytes]]:
    """For each text, the texts (itself included) that an occurrence of it can overlap in
    some string, other than itself at the same place: one contains the other, or a proper
    suffix of one is a prefix of the other. Only texts with some overlap are keys.

    Without comparing every pair: substrings are looked up by the lengths texts have, and
    suffixes in a table of prefixes, so the cost is about the texts' total length times
    their distinct lengths, plus the overlapping pairs found."""
    known = set(texts)
    lengths = sorted({len(t) for t in texts})
    found: dict[bytes, set[bytes]] = {}

    def pair(u: bytes, v: bytes) -> None:
        found.setdefault(u, set()).add(v)
        found.setdefault(v, set()).add(u)

    prefixes: dict[bytes, list[bytes]] = {}
    for t in texts:
        for k in range(1, len(t)):
            prefixes.setdefault(t[:k], []).append(t)
    for t in texts:
        # Texts inside t (at any place; t itself only elsewhere than at 0, which a proper
        # border below covers).
        for size in lengths:
            if size >= len(t):
                break
            for i in range(len(t) - size + 1):
                if t[i : i + size] in known:
                    pair(t, t[i : i + size])
        # A proper suffix of t that begins another text (t itself: a border, as `abab`).
        for k in range(1, len(t)):
            for v in prefixes.get(t[len(t) - k :], ()):
                pair(t, v)
    return found


def _longest_match(texts: list[bytes]) -> re.Pattern[bytes] | None:
    """A pattern matching the longest of `texts` at a position, written as a trie: a plain
    alternation of thousands of tokens costs the regex engine a try of each at every
    candidate position (measured: 2.3 s for 420 KB with 6,000 special tokens); the trie
    costs the length of the match."""
    if not texts:
        return None
    trie: dict[int, Any] = {}
    for text in texts:
        node = trie
        for byte in text:
            node = node.setdefault(byte, {})
        node[-1] = {}  # the end of a text

    def emit(node: dict[int, Any]) -> bytes:
        run = b""  # a chain of single bytes, without recursing (a long token is a long chain)
        while -1 not in node and len(node) == 1:
            [(byte, node)] = node.items()
            run += re.escape(bytes([byte]))
        ends = -1 in node
        branches = [re.escape(bytes([b])) + emit(child) for b, child in node.items() if b != -1]
        if not branches:
            return run
        body = branches[0] if len(branches) == 1 else b"(?:" + b"|".join(branches) + b")"
        # Longer first: the continuation is tried before ending here.
        return run + (b"(?:" + body + b")?" if ends else body)

    return re.compile(emit(trie))


def _first_characters(texts: list[bytes]) -> str | None:
    firsts = set()
    for t in texts:
        first = t[:4].decode(errors="replace")[0]
        if first == "\ufffd":
            return None
        firsts.add(first)
    return "".join(sorted(firsts)) if len(firsts) <= _MAX_MARKS else None


def cut_points(data: bytes, specials: SpecialTokens, every: int = EVERY) -> list[tuple[int, int]]:
    """Exact cuts of `data`, about every `every` special-token occurrences: (end, resume)
    pairs, the piece before a cut being data[previous resume:end]. Empty when the text has
    `every` occurrences or fewer (tokenize it whole)."""
    pattern = specials.pattern
    if pattern is None:
        return []
    cuts: list[tuple[int, int]] = []
    since = 0
    for match in pattern.finditer(data):
        since += 1
        if since < every:
            continue
        start = match.start()
        resume = specials._clean(data, start, specials.by_text[match.group()])
        if resume is not None:
            cuts.append((match.end(), resume))
            since = 0
    return cuts
