"""A burst's members one by one: which first tokens the runner may decode ahead, and a member
that leaves mid-burst (aborted, or failed with its step) holding nobody else up.

On the sim runner under Trio's autojump clock, with test_scheduler.py's latencies and helpers:
every time below is computed from the same step costs the scheduler pays. A burst that waited
for a member that has left would hold its decodes forever; each test bounds its engine's life
in Trio clock so that shows as a failure, not a hang.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio
import trio.testing

# --import-mode=importlib does not put test directories on sys.path.
sys.path.insert(0, str(Path(__file__).parent))

from test_scheduler import collect, request, sim_config, step_cost

from tributary import engine, testing
from tributary.engine import Done, EngineConfig, Error, Frame, GenerateRequest
from tributary.engine.runners.base import DecodeRun, RunFeed, SeqStep
from tributary.engine.runners.sim import SimRunner

#: Virtual seconds within which every test's requests end (each takes well under one).
DEADLINE = 10.0

Items = list[tuple[float, engine.Output]]


class RecordingRunner(SimRunner):
    """The sim runner, noting every plan the scheduler hands it (a run's plan once, not the
    decodes the runner plans within it)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(
            context_length=config.context_length or 8192,
            latency=config.sim_latency,
            fail_at_step=config.sim_fail_at_step,
        )
        self.plans: list[list[SeqStep]] = []
        self._in_run = False

    async def step(self, plan: Sequence[SeqStep]) -> list[int]:
        if not self._in_run:
            self.plans.append(list(plan))
        return await super().step(plan)

    async def decode_run(self, plan: Sequence[SeqStep], run: DecodeRun, feed: RunFeed) -> None:
        self.plans.append(list(plan))
        self._in_run = True
        try:
            await super().decode_run(plan, run, feed)
        finally:
            self._in_run = False


def member(i: int, *, tokens: int = 4, length: int = 60) -> GenerateRequest:
    """Burst member i: a prompt of `length` copies of one letter, rid `m{i}`."""
    return dataclasses.replace(request(chr(65 + i) * length, max_new_tokens=tokens), rid=f"m{i}")


def frame_times(items: Items) -> list[float]:
    return [t for t, item in items if isinstance(item, Frame)]


async def run_requests(eng: engine.Engine, requests: list[GenerateRequest]) -> list[Items]:
    """Submit `requests` at once and read each to its end (within DEADLINE of Trio clock)."""
    results: list[Items] = [[] for _ in requests]
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            for req, items in zip(requests, results, strict=True):
                nursery.start_soon(collect, eng.submit(req), items)
    return results


async def test_only_the_first_tokens_a_burst_holds_are_kept_from_decoding_ahead(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Twelve 60-token prompts arrive at once (a burst: three waves of four under a 256-token
    budget) and a short one a step later (alone at its boundary, so no member). The runner is
    told not to decode ahead the first tokens of waves one and two, which wait for the rest;
    the third wave's, which complete the burst and decode next step, and the late request's,
    sampled in the same step as the second wave's, it may decode ahead as any other token."""
    config = sim_config(max_running_requests=16, max_prefill_tokens=256)
    runner = RecordingRunner(config)
    async with engine.open_engine(config, runner=runner) as eng:
        members = [member(i) for i in range(12)]
        late = dataclasses.replace(request("z" * 10, max_new_tokens=4), rid="late")
        prompts = {req.rid: eng.tokenize(req.text) for req in [*members, late]}
        results: list[Items] = [[] for _ in range(13)]
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                for req, items in zip(members, results[:12], strict=True):
                    nursery.start_soon(collect, eng.submit(req), items)
                await trio.sleep(0.001)  # the first wave's prefill is running
                nursery.start_soon(collect, eng.submit(late), results[12])
    for items in results:
        done = items[-1][1]
        assert isinstance(done, Done) and done.completion_tokens == 4, done

    # Name each plan entry: a prompt's last chunk by its tokens, a decode by its slot.
    by_slot: dict[int, str] = {}
    first_tokens: dict[int, list[str]] = {}  # plan index -> requests sampling a first token
    for i, plan in enumerate(runner.plans):
        for entry in plan:
            rid = next((r for r, ids in prompts.items() if ids == entry.tokens), None)
            if rid is not None:
                assert entry.sample and entry.start_pos == 0
                by_slot[entry.seq_id] = rid
                first_tokens.setdefault(i, []).append(rid)
    wave = [[f"m{i}" for i in range(k, k + 4)] for k in (0, 4, 8)]
    assert first_tokens == {0: wave[0], 1: [*wave[1], "late"], 2: wave[2]}
    not_ahead = [
        (i, by_slot[entry.seq_id])
        for i, plan in enumerate(runner.plans)
        for entry in plan
        if not entry.decode_ahead
    ]
    assert not_ahead == [(0, rid) for rid in wave[0]] + [(1, rid) for rid in wave[1]]
    # The late request decodes beside the third wave; the burst all at once after it.
    assert [by_slot[entry.seq_id] for entry in runner.plans[2]] == [*wave[2], "late"]
    assert sorted(by_slot[entry.seq_id] for entry in runner.plans[3]) == sorted(
        [*wave[0], *wave[1], *wave[2], "late"]
    )


async def test_a_member_aborted_mid_burst_ends_and_the_rest_decode_without_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Twelve prompts in three waves; once the first wave has its first tokens, m0 (which has
    one) and m10 (of the third wave, not yet prefilled) are aborted. Both end with the abort
    and what they had; the other ten get their second tokens together one step after the
    third wave's first tokens, and all four tokens each."""
    config = sim_config(max_running_requests=16, max_prefill_tokens=256)
    async with engine.open_engine(config) as eng:
        results: list[Items] = [[] for _ in range(12)]
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                for i, items in enumerate(results):
                    nursery.start_soon(collect, eng.submit(member(i)), items)
                while not results[0]:
                    await trio.sleep(0.001)
                await trio.testing.wait_all_tasks_blocked()  # the second wave's step runs
                assert [len(items) for items in results] == [1] * 4 + [0] * 8
                assert eng.abort("m0") == 1 and eng.abort("m10") == 1
        await testing.wait_engine_idle(eng)
    aborted = {0: 1, 10: 0}  # member -> tokens it had
    for i, tokens in aborted.items():
        done = results[i][-1][1]
        assert isinstance(done, Done), done
        assert done.finish_reason == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }
        assert done.completion_tokens == tokens
    third_wave = 2 * step_cost(prefill=240) + step_cost(prefill=180)  # m8, m9, m11
    second_token = third_wave + step_cost(decoding=10)
    for i, items in enumerate(results):
        if i in aborted:
            continue
        done = items[-1][1]
        assert isinstance(done, Done), done
        assert done.finish_reason == {"type": "length", "length": 4}
        assert done.completion_tokens == 4
        frames = frame_times(items)
        assert frames[0] == pytest.approx(
            [step_cost(prefill=240), 2 * step_cost(prefill=240), third_wave][i // 4]
        )
        assert frames[1] == pytest.approx(second_token)


async def test_members_outside_a_failed_step_finish_once_the_rest_have_first_tokens(
    autojump_clock: trio.abc.Clock,
) -> None:
    """64-token chunks, a 128-token step budget, five prompts in a burst: A and B (60 tokens)
    get their first tokens in step 1; step 2, holding C's first chunk (of 200 tokens) and
    D (60), fails, so C and D end with a 500. E (60), which no failed step held, prefills in
    step 3; A and B, held till then, get their second tokens with E's in step 4, and all
    three finish."""
    config = sim_config(prefill_chunk_tokens=64, max_prefill_tokens=128, sim_fail_at_step=2)
    async with engine.open_engine(config) as eng:
        lengths = [60, 60, 200, 60, 60]
        requests = [member(i, length=n) for i, n in enumerate(lengths)]
        results = await run_requests(eng, requests)
        await testing.wait_engine_idle(eng)
    a, b, c, d, e = results
    step1 = step_cost(prefill=120)
    failed_at = step1 + step_cost(prefill=64 + 60)
    for items in (c, d):
        at, last = items[-1]
        assert isinstance(last, Error), last
        assert last.error.http_status == 500
        assert "injected failure at step 2" in last.error.message
        assert at == pytest.approx(failed_at)
        assert frame_times(items) == []
    e_first = failed_at + step_cost(prefill=60)
    second_token = e_first + step_cost(decoding=3)
    for items, first in ((a, step1), (b, step1), (e, e_first)):
        done = items[-1][1]
        assert isinstance(done, Done), done
        assert done.finish_reason == {"type": "length", "length": 4}
        assert done.completion_tokens == 4
        frames = frame_times(items)
        assert frames[:2] == pytest.approx([first, second_token])
