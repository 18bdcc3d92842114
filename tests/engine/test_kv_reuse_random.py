"""Random workloads on the sim runner: prompts sharing chunk prefixes,
identical prompts submitted together (forks), aborts at random moments and a cache small
enough to evict, run with the prefix cache and forks on and again with both off. Every
request that completes in both runs gets the same tokens, and the engine ends idle with the
cache's bound held and no pin left."""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio

from tributary import engine, testing
from tributary.engine import Done, Error, Frame, GenerateRequest, SamplingParams, SimLatency

LAT = SimLatency(step_base=0.010, decode_per_seq=0.002, prefill_per_token=0.001)

#: (arrival time, prompt ids, sampling params, seconds after which the client leaves)
Work = list[tuple[float, list[int], dict[str, Any], float | None]]


def make_workload(seed: int) -> Work:
    rng = random.Random(seed)
    bases = [[3 + rng.randrange(250) for _ in range(rng.choice([300, 520, 800]))] for _ in range(3)]
    work: Work = []
    at = 0.0
    for _ in range(24):
        at += rng.choice([0, 0, 0.005, 0.02, 0.1])
        base = rng.choice(bases)
        cut = rng.choice([0, 100, 256, 257, 512, len(base)])
        ids = base[:cut] + [3 + rng.randrange(250) for _ in range(rng.choice([0, 1, 5, 40]))]
        params: dict[str, Any] = {"temperature": 0, "max_new_tokens": rng.choice([1, 3, 10, 30])}
        if rng.random() < 0.4:
            params.update(temperature=0.7, sampling_seed=rng.randrange(100))
        if rng.random() < 0.2:
            params["min_new_tokens"] = min(2, params["max_new_tokens"])
        leave_after = rng.choice([None, None, None, 0.001, 0.015, 0.05])
        for _ in range(rng.choice([1, 1, 1, 3])):  # 3: like n = 3
            work.append((at, ids or [5], params, leave_after))
    return work


async def run_workload(config: engine.EngineConfig, work: Work) -> list[list[int] | None]:
    """Each request's output ids if it ended (Done) while its client was still there; no
    request may end with an Error (a runner's failed check fails its step)."""
    results: list[list[int] | None] = [None] * len(work)
    async with testing.open_sim_engine(config) as eng:
        start = trio.current_time()

        async def one(i: int) -> None:
            at, ids, params, leave_after = work[i]
            await trio.sleep_until(start + at)
            request = GenerateRequest(input_ids=ids, sampling=SamplingParams.from_dict(params))
            stream = eng.submit(request)
            items = []
            with trio.move_on_after(1e9 if leave_after is None else leave_after):
                async with stream:
                    async for item in stream:
                        items.append(item)
            assert not any(isinstance(item, Error) for item in items), items[-1]
            if items and isinstance(items[-1], Done):
                results[i] = [
                    t for it in items if isinstance(it, Frame | Done) for t in it.output_ids
                ]

        async with trio.open_nursery() as nursery:
            for i in range(len(work)):
                nursery.start_soon(one, i)
        await testing.wait_engine_idle(eng)
        cache = eng._scheduler.prefix_cache
        if cache is not None:
            assert cache.bytes == sum(e.nbytes for e in cache) <= cache.capacity_bytes
            assert cache.pins == 0
    return results


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("cache_mb", [1, 64])  # 1 MiB: about 1,000 sim tokens, so evictions
async def test_same_tokens_with_and_without_kv_reuse(
    seed: int, cache_mb: int, autojump_clock: trio.abc.Clock
) -> None:
    work = make_workload(seed)
    common = {"sim_latency": LAT, "max_running_requests": 4}
    on = testing.sim_config(prefix_cache_mb=cache_mb, **common)
    off = testing.sim_config(prefix_cache_mb=0, fork_parallel_samples=False, **common)
    with_reuse, without = await run_workload(on, work), await run_workload(off, work)
    compared = 0
    for i, (a, b) in enumerate(zip(with_reuse, without, strict=True)):
        # A client that left may have left at another token in the other run.
        if a is not None and b is not None and len(a) == len(b):
            assert a == b, (i, work[i])
            compared += 1
    assert compared
