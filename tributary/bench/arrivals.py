"""How the requests of a run are dispatched over time.

- `fixed_concurrency`: N worker tasks in one nursery pull prompt indices from a channel, so
  exactly N requests are in flight until the channel runs dry.
- `poisson_arrivals`: a dispatcher starts request i, then sleeps an exponential gap of mean
  1/rate seconds from a generator seeded with the run's seed; with a concurrency too, each
  request first takes a slot of a CapacityLimiter (FIFO, so arrival order is kept, and the
  wait is not part of its latencies, as in bench_serving and vllm bench serve). An infinite
  rate with no concurrency sends every request at once, as both of those do by default.

Both return when every request has finished; `send(i)` must not raise for a failed request.
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable

import trio

__all__ = ["fixed_concurrency", "poisson_arrivals"]


async def fixed_concurrency(
    count: int, concurrency: int, send: Callable[[int], Awaitable[None]]
) -> None:
    indices_in, indices_out = trio.open_memory_channel[int](count)
    for i in range(count):
        indices_in.send_nowait(i)
    indices_in.close()

    async def worker(indices: trio.MemoryReceiveChannel[int]) -> None:
        async with indices:
            async for i in indices:
                await send(i)

    async with trio.open_nursery() as nursery, indices_out:
        for _ in range(min(concurrency, count)):
            nursery.start_soon(worker, indices_out.clone())


async def poisson_arrivals(
    count: int,
    rate: float,
    concurrency: int | None,
    seed: int,
    send: Callable[[int], Awaitable[None]],
) -> None:
    arrivals = random.Random(f"{seed}:arrivals")
    limiter = trio.CapacityLimiter(concurrency) if concurrency is not None else None

    async def limited(i: int) -> None:
        if limiter is None:
            await send(i)
        else:
            async with limiter:
                await send(i)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(limited, i)
            if not math.isinf(rate) and i + 1 < count:
                await trio.sleep(arrivals.expovariate(rate))
