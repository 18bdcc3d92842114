"""What one worker has probably cached: a radix tree of the prompts sent to it, bounded in
size, for the cache-aware policy.

Synopsis::

    tree = RadixTree(max_size=1 << 22)
    tree.insert("You are a helpful assistant. Hi")      # when a prompt is sent to the worker
    tree.match("You are a helpful assistant. Bye")      # -> 29, the length of the shared prefix

It is SGLang's "approximate tree" (sgl-router `policies/tree.rs`): the router never asks a
worker what its KV cache holds, it remembers what it sent there. SGLang keeps one tree for all
workers and evicts from a background thread every 120 s; Tributary keeps one tree per worker
and evicts as it inserts, which needs no task and keeps the bound at every moment.

Keys are `str`: prompt text as it is, token ids as one code point each (`token_key`), so a
token prompt costs 4 bytes an id and prefixes compare in C. `size` counts the characters held
(each shared prefix once); past `max_size` the least recently inserted leaves go first. Every
node but the root holds at least one character, so nodes, and the heap that orders the leaves,
are bounded by `max_size` too.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Sequence

__all__ = ["RadixTree", "token_key"]

#: Code points run to 0x10FFFF; no tokenizer has that many ids. One outside the range (which the
#: worker rejects anyway) folds into it: the tree is approximate and must not fail a request.
_CODE_POINTS = 0x110000
_UINT32 = next(code for code in "IL" if array(code).itemsize == 4)


def token_key(input_ids: Sequence[int]) -> str:
    """The ids as a string, one code point each. Decoding them as UTF-32 takes 9 us for 1500
    ids where `chr` one by one takes 60 us, and the event loop pays it twice a request."""
    try:
        return array(_UINT32, input_ids).tobytes().decode("utf-32-le", "surrogatepass")
    except (OverflowError, UnicodeDecodeError):
        return "".join(chr(i % _CODE_POINTS) for i in input_ids)


class _Node:
    __slots__ = ("children", "parent", "text", "tick")

    def __init__(self, text: str, parent: _Node | None, tick: int) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}  # keyed by the child's first character
        self.tick = tick  # the last insert that passed through this node


def _shared_prefix(a: str, b: str) -> int:
    """How many leading characters a and b share: a binary search over slice equality, which
    runs in C, instead of a Python loop over the characters of prompts thousands long."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


class RadixTree:
    """A radix tree of strings bounded to `max_size` characters, evicting least recently
    inserted leaves. Used from one Trio run (no locking)."""

    def __init__(self, *, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be at least 1, not {max_size}")
        self.max_size = max_size
        self.size = 0
        self._clock = itertools.count(1)
        self._root = _Node("", None, 0)
        self._nodes = 0
        # Leaves by (tick, serial): an entry is stale once its node was passed through again,
        # grew children or left the tree; stale entries are skipped and, when they pile up
        # (one prompt sent again and again), dropped by rebuilding the heap.
        self._leaves: list[tuple[int, int, _Node]] = []
        self._serial = itertools.count()

    def match(self, key: str) -> int:
        """The length of the longest prefix of `key` in the tree."""
        node, at = self._root, 0
        while at < len(key):
            child = node.children.get(key[at])
            if child is None:
                break
            shared = _shared_prefix(child.text, key[at : at + len(child.text)])
            at += shared
            if shared < len(child.text):
                break
            node = child
        return at

    def insert(self, key: str) -> None:
        """Hold `key`, mark its path most recently used, then evict down to `max_size`."""
        tick = next(self._clock)
        node, at = self._root, 0
        while at < len(key):
            child = node.children.get(key[at])
            if child is None:
                child = _Node(key[at:], node, tick)
                node.children[key[at]] = child
                self.size += len(child.text)
                self._nodes += 1
                node = child
                break
            shared = _shared_prefix(child.text, key[at : at + len(child.text)])
            if shared < len(child.text):
                child = self._split(child, shared)
            child.tick = tick
            node, at = child, at + shared
        if node is not self._root and not node.children:
            self._push_leaf(node)
        self._evict()

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node` after `at` characters; returns the new upper part (the lower part keeps
        its children, tick and heap entry)."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.text[:at], parent, node.tick)
        parent.children[upper.text[0]] = upper
        node.text = node.text[at:]
        node.parent = upper
        upper.children[node.text[0]] = node
        self._nodes += 1
        return upper

    def _push_leaf(self, node: _Node) -> None:
        if len(self._leaves) > 2 * self._nodes + 16:
            self._leaves = [e for e in self._leaves if self._is_current(e)]
            heapq.heapify(self._leaves)
        heapq.heappush(self._leaves, (node.tick, next(self._serial), node))

    @staticmethod
    def _is_current(entry: tuple[int, int, _Node]) -> bool:
        tick, _serial, node = entry
        return node.tick == tick and not node.children and node.parent is not None

    def _evict(self) -> None:
        while self.size > self.max_size and self._leaves:
            entry = heapq.heappop(self._leaves)
            if not self._is_current(entry):
                continue
            leaf = entry[2]
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.text[0]]
            leaf.parent = None
            self.size -= len(leaf.text)
            self._nodes -= 1
            if parent is not self._root and not parent.children:
                self._push_leaf(parent)
