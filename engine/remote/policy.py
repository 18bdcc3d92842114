"""Which available worker gets a request: SGLang's model gateway policies (sgl-router
`policies/`), over the workers that `Fleet.choose` found available.

Synopsis::

    policy = make_policy("cache_aware")
    worker = policy.choose(candidates, "You are a helpful assistant. Hi")
    policy.record_dispatch(worker, "You are a helpful assistant. Hi")

- `round_robin`: each in turn; an unavailable worker is skipped.
- `power_of_two`: sample two, take the one with fewer requests in flight (Mitzenmacher's "power
  of two choices": nearly the balance of least-loaded without herding every request onto the
  one worker that looked idle a moment ago).
- `cache_aware` (the default): send a prompt where its prefix was sent before, so the worker's
  prefix cache serves it, unless the load is out of balance. See `CacheAware`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from .radix_tree import RadixTree, token_key
from .worker import Worker

__all__ = [
    "POLICIES",
    "CacheAware",
    "Policy",
    "PowerOfTwo",
    "RoundRobin",
    "RoutingKey",
    "make_policy",
]

POLICIES = ("round_robin", "power_of_two", "cache_aware")

#: What a request is routed by: its prompt text, or its prompt's token ids.
RoutingKey = str | Sequence[int]


class Policy(Protocol):
    """Picks among candidates (never empty, in the fleet's order, all available)."""

    name: str

    def choose(self, candidates: Sequence[Worker], key: RoutingKey | None) -> Worker: ...

    def record_dispatch(self, worker: Worker, key: RoutingKey | None) -> None:
        """A request with `key` was sent to `worker`."""

    def forget(self, worker: Worker) -> None:
        """`worker` left the fleet: drop what is kept about it."""


def make_policy(name: str, *, seed: int | None = None) -> Policy:
    """The policy called `name` with its defaults; `seed` makes random choices repeatable."""
    if name == "round_robin":
        return RoundRobin()
    if name == "power_of_two":
        return PowerOfTwo(seed=seed)
    if name == "cache_aware":
        return CacheAware()
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


def _least_loaded(candidates: Sequence[Worker]) -> Worker:
    """Fewest requests in flight; the first in the fleet's order among equals."""
    return min(candidates, key=lambda w: w.in_flight)


class RoundRobin:
    """SGLang's counter modulo the candidates: with all workers available a strict cycle;
    while one is out, the others share its turns."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Worker], key: RoutingKey | None) -> Worker:
        worker = candidates[self._turn % len(candidates)]
        self._turn += 1
        return worker

    def record_dispatch(self, worker: Worker, key: RoutingKey | None) -> None:
        pass

    def forget(self, worker: Worker) -> None:
        pass


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, *, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def choose(self, candidates: Sequence[Worker], key: RoutingKey | None) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._random.sample(list(candidates), 2)
        return first if first.in_flight <= second.in_flight else second

    def record_dispatch(self, worker: Worker, key: RoutingKey | None) -> None:
        pass

    def forget(self, worker: Worker) -> None:
        pass


class CacheAware:
    """SGLang's cache-aware routing over one `RadixTree` per worker (and per kind of key: text
    and token ids never share a prefix).

    While the load is out of balance (the most loaded candidate has more than
    `balance_abs_threshold` requests in flight above the least loaded, and more than
    `balance_rel_threshold` times as many), the least loaded gets the request. Otherwise the
    worker whose tree shares the longest prefix with the prompt gets it, if that prefix is at
    least `cache_threshold` of the prompt; if not, the worker with the smallest tree (the most
    room in its cache). Ties, in either case, go to the less loaded. The defaults are SGLang's;
    `max_tree_size` (characters or tokens per tree) is smaller than SGLang's 2**26 because a
    Python tree costs more per character.

    Differences from SGLang: the load is compared among the candidates (SGLang counts unhealthy
    workers too, so one stuck worker can hold the fleet in load-balancing mode); a request
    without a key goes to the least loaded (SGLang matches it as "" and always picks the
    smallest tree, which sends every such request to one worker); a match exactly at
    `cache_threshold` counts as a hit (SGLang wants more).
    """

    name = "cache_aware"

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 1 << 22,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self._text: dict[Worker, RadixTree] = {}
        self._tokens: dict[Worker, RadixTree] = {}

    def choose(self, candidates: Sequence[Worker], key: RoutingKey | None) -> Worker:
        if key is None or len(key) == 0 or self._imbalanced(candidates):
            return _least_loaded(candidates)
        trees, text = self._trees(key)
        matches = [trees[w].match(text) if w in trees else 0 for w in candidates]
        best = max(matches)
        if best / len(text) >= self.cache_threshold:
            hits = [w for w, m in zip(candidates, matches, strict=True) if m == best]
            return _least_loaded(hits)
        # Trees stay empty until dispatches are recorded: then this is least-loaded routing.
        return min(candidates, key=lambda w: (trees[w].size if w in trees else 0, w.in_flight))

    def record_dispatch(self, worker: Worker, key: RoutingKey | None) -> None:
        if key is None or len(key) == 0 or worker.removed:
            return
        trees, text = self._trees(key)
        tree = trees.get(worker)
        if tree is None:
            tree = trees[worker] = RadixTree(max_size=self.max_tree_size)
        tree.insert(text)

    def forget(self, worker: Worker) -> None:
        self._text.pop(worker, None)
        self._tokens.pop(worker, None)

    def tree_size(self, worker: Worker) -> int:
        """Characters and tokens held for `worker` (both its trees)."""
        return sum(trees[worker].size for trees in (self._text, self._tokens) if worker in trees)

    def _imbalanced(self, candidates: Sequence[Worker]) -> bool:
        loads = [w.in_flight for w in candidates]
        low, high = min(loads), max(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def _trees(self, key: RoutingKey) -> tuple[dict[Worker, RadixTree], str]:
        if isinstance(key, str):
            return self._text, key
        return self._tokens, token_key(key)
