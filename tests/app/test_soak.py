"""The disconnect soak (tributary.bench.soak) on the sim model, over real sockets: 1,000
requests in two rounds of 500, mixing unary, batch, both stream modes (two servers on one
engine, one of them with incremental streaming output) and `/v1` streams, 48 clients at a
time, 40% of them closing at a random moment. Every client that stays gets a complete,
correct answer; afterwards the engine holds nothing, no task is left, and nothing was
logged as an error (an exception escaping the app is only logged by Hypercorn).

RSS is compared after each round: the second round must not keep what the first did not
(a loose bound; the figures are printed and recorded in docs/reliability.md).
"""

from __future__ import annotations

import gc
import logging

import pytest
import trio
import trio.testing
from apphelpers import chat_sim_runner

from tributary.app import open_http_server
from tributary.bench.soak import live_tasks, plan_jobs, rss_mib, run_soak
from tributary.engine import SimLatency, open_engine
from tributary.testing import assert_engine_idle, server_settings, sim_config, wait_engine_idle

#: Steps cost a little, so that requests overlap: decodes batch and prefills interleave.
SOAK_ENGINE = sim_config(
    sim_latency=SimLatency(step_base=0.002, decode_per_seq=0.0002, prefill_per_token=0.00002)
)
ROUNDS, PER_ROUND = 2, 500
#: How much RSS the second round may add to the first's, in MiB.
RSS_GROWTH_BOUND = 24.0


async def wait_for_tasks(baseline: list[str], *, timeout: float = 10.0) -> None:
    """Connection tasks end shortly after their sockets close."""
    with trio.move_on_after(timeout):
        while live_tasks() != baseline:
            await trio.sleep(0.01)
    left = sorted((set(live_tasks()) ^ set(baseline)) | _extra(live_tasks(), baseline))
    assert live_tasks() == baseline, f"tasks left after the round: {left}"


def _extra(now: list[str], before: list[str]) -> set[str]:
    counts = {name: now.count(name) - before.count(name) for name in set(now)}
    return {f"{name} x{n}" for name, n in counts.items() if n}


async def test_disconnect_soak_leaves_nothing_behind(caplog: pytest.LogCaptureFixture) -> None:
    async with open_engine(SOAK_ENGINE, runner=chat_sim_runner(SOAK_ENGINE)) as engine:
        async with (
            open_http_server(engine, server_settings()) as cumulative,
            open_http_server(engine, server_settings(incremental_streaming_output=True)) as inc,
        ):
            urls = {"cumulative": cumulative[0], "incremental": inc[0]}
            await trio.testing.wait_all_tasks_blocked()  # the listeners have started
            baseline = live_tasks()
            rss = []
            for round_ in range(ROUNDS):
                result = await run_soak(plan_jobs(PER_ROUND, seed=round_), urls, concurrency=48)
                assert result.failures == [], result.failures[:5]
                assert result.requests == PER_ROUND and result.disconnects > PER_ROUND // 4
                # A client that left mid-request asked for 2,000 tokens: unless its request
                # was aborted, the engine is still busy seconds later.
                await wait_engine_idle(engine, timeout=0.5)
                assert_engine_idle(engine)
                assert engine._live == {}
                stats = engine.stats()
                assert (stats.running, stats.waiting, stats.kv_used_cells) == (0, 0, 0)
                await wait_for_tasks(baseline)
                gc.collect()
                rss.append(rss_mib())
                print(
                    f"round {round_ + 1}: {result.requests} requests, {result.disconnects} "
                    f"disconnects, {result.ended_before_leaving} ended before the client "
                    f"left, {stats.generated_tokens} tokens so far; RSS {rss[-1]:.1f} MiB"
                )
            assert rss[1] - rss[0] < RSS_GROWTH_BOUND, rss
    # Hypercorn logs what escapes the app ("Error in ASGI Framework"); nothing may.
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
