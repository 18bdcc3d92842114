"""Decode runs, on the sim runner under Trio's autojump clock: while every running request is
simply decoding, a step goes on decoding without the scheduler in between, and nothing a
client can see changes but how often it is woken: the same tokens, the same finish reasons,
the same times, arrivals and aborts acted on as soon as without runs.

Each test runs the same workload with runs (the default, `max_run_decodes=64`) and without
(`max_run_decodes=1`) and compares what the clients got.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

from tributary import engine, testing
from tributary.engine import Done, EngineConfig, Frame, GenerateRequest, SamplingParams

RUNS = 64

#: What one client saw: (arrival time since the workload began, item) for each item.
Seen = list[tuple[float, engine.Output]]


def sim_config(**overrides: Any) -> EngineConfig:
    return testing.sim_config(max_running_requests=4, **overrides)


def request(
    text: str, *, stream: bool = True, rid: str | None = None, **sampling: Any
) -> GenerateRequest:
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True, **sampling}
    return GenerateRequest(
        text=text, rid=rid, sampling=SamplingParams.from_dict(params), stream=stream
    )


async def serve(
    max_run: int,
    requests: list[tuple[float, GenerateRequest]],
    during: Callable[[engine.Engine, float], Awaitable[None]] | None = None,
) -> tuple[list[Seen], engine.EngineStats]:
    """Submit each request at its time (seconds after the start) and read it to its end;
    `during(engine, start)` runs beside them. Returns what each client saw, and the
    engine's stats once all ended."""
    seen: list[Seen] = [[] for _ in requests]
    async with engine.open_engine(sim_config(max_run_decodes=max_run)) as eng:
        start = trio.current_time()

        async def client(i: int, at: float, req: GenerateRequest) -> None:
            await trio.sleep_until(start + at)
            async with eng.submit(req) as stream:
                async for item in stream:
                    seen[i].append((trio.current_time() - start, item))

        async with trio.open_nursery() as nursery:
            for i, (at, req) in enumerate(requests):
                nursery.start_soon(client, i, at, req)
            if during is not None:
                nursery.start_soon(during, eng, start)
        await testing.wait_engine_idle(eng)
        stats = eng.stats()
    return seen, stats


def answer(items: Seen) -> tuple[str, list[int], dict[str, Any], float]:
    """Everything a unary client keeps: the text, the ids, the finish reason, and when the
    answer came."""
    text = "".join(item.text for _, item in items if isinstance(item, Frame | Done))
    ids = [t for _, item in items if isinstance(item, Frame | Done) for t in item.output_ids]
    at, done = items[-1]
    assert isinstance(done, Done)
    return text, ids, done.finish_reason, at


def same_answer(ran: Seen, alone: Seen) -> None:
    text, ids, reason, at = answer(ran)
    assert (text, ids, reason) == answer(alone)[:3]
    assert at == pytest.approx(answer(alone)[3])


def stream_view(items: Seen) -> list[tuple[float, int]]:
    """What a streaming client sees: when each count of tokens arrived."""
    return [(at, item.completion_tokens) for at, item in items if isinstance(item, Frame | Done)]


def same_view(ran: Seen, alone: Seen) -> None:
    times, counts = zip(*stream_view(ran), strict=True)
    alone_times, alone_counts = zip(*stream_view(alone), strict=True)
    assert counts == alone_counts
    assert times == pytest.approx(alone_times)


async def test_runs_give_the_tokens_ends_and_times_single_steps_give(
    autojump_clock: trio.abc.Clock,
) -> None:
    # A run ends at a stop token and at a length; a stop string needs each decode's text;
    # the requests arrive at different times, so runs begin and end around prefills.
    workload = [
        (0.0, request("greedy unary", stream=False)),
        (0.0, request("greedy stream", max_new_tokens=25)),
        (0.2, request("seeded", stream=False, temperature=0.8, top_p=0.9, sampling_seed=7)),
        (0.3, request("late", stream=False, max_new_tokens=12)),
    ]
    plain, _ = await serve(1, workload)
    # A stop token and a stop string that occur in the output (the sim's greedy output is
    # a function of the prompt): the 20th token, and the text of tokens 16-18.
    probe, probe_ids = answer(plain[0])[:2]
    stop = probe[15:18]
    workload += [
        (
            0.05,
            request("greedy unary", stream=False, ignore_eos=False, stop_token_ids=[probe_ids[19]]),
        ),
        (0.4, request("greedy unary", stream=False, stop=[stop])),
    ]
    plain, plain_stats = await serve(1, workload)
    runs, runs_stats = await serve(RUNS, workload)
    for alone, ran in zip(plain, runs, strict=True):
        same_answer(ran, alone)
    assert answer(runs[-2])[2] == {"type": "stop", "matched": probe_ids[19]}
    assert len(answer(runs[-2])[1]) <= 20  # ended by the stop token, at its first
    assert answer(runs[-1])[2] == {"type": "stop", "matched": stop}
    assert probe.startswith(answer(runs[-1])[0])  # trimmed at the stop string
    # A streamed request sees every token when it is sampled, as without runs.
    same_view(runs[1], plain[1])
    assert len(stream_view(runs[1])) == 25
    # Every decode of a run is a step.
    assert runs_stats.steps == plain_stats.steps
    assert runs_stats.generated_tokens == plain_stats.generated_tokens


async def test_a_unary_run_ends_at_a_stop_token_or_string_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Alone and unary, nobody reads its tokens before the end: a stop token is seen where
    it is sampled, and a stop string is looked for after each decode all the same."""
    (probe,), _ = await serve(1, [(0.0, request("stop here", stream=False))])
    text, ids = answer(probe)[:2]
    for sampling in ({"stop_token_ids": [ids[19]], "ignore_eos": False}, {"stop": [text[20:23]]}):
        workload = [(0.0, request("stop here", stream=False, **sampling))]
        (plain,), plain_stats = await serve(1, workload)
        (ran,), run_stats = await serve(RUNS, workload)
        same_answer(ran, plain)
        assert answer(ran)[2]["type"] == "stop"
        assert len(answer(ran)[1]) < 40
        assert run_stats.steps == plain_stats.steps  # no decode past the end


async def test_a_unary_request_gets_its_tokens_in_a_few_frames(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Alone, a unary request's decodes are runs: its tokens come in one frame a run, where
    a streamed request gets one a token."""
    (unary,), _ = await serve(RUNS, [(0.0, request("a", stream=False, max_new_tokens=150))])
    frames = [item for _, item in unary if isinstance(item, Frame)]
    assert 1 <= len(frames) <= 1 + 150 // RUNS
    assert len(answer(unary)[1]) == 150
    (streamed,), _ = await serve(RUNS, [(0.0, request("a", max_new_tokens=150))])
    assert len(streamed) == 150


async def test_a_request_arriving_during_a_run_starts_as_soon_as_without_runs(
    autojump_clock: trio.abc.Clock,
) -> None:
    workload = [
        (0.0, request("long unary request", stream=False, max_new_tokens=200)),
        (0.4567, request("arrives mid-run", stream=False, max_new_tokens=5)),
        (0.9, request("and another", max_new_tokens=5)),
    ]
    plain, _ = await serve(1, workload)
    runs, _ = await serve(RUNS, workload)
    for alone, ran in zip(plain, runs, strict=True):
        same_answer(ran, alone)
    same_view(runs[2], plain[2])


async def test_an_abort_during_a_run_ends_the_request_as_soon_as_without_runs(
    autojump_clock: trio.abc.Clock,
) -> None:
    freed: list[float] = []

    async def abort_then_watch(eng: engine.Engine, start: float) -> None:
        await trio.sleep_until(start + 0.3333)
        assert eng.abort("victim") == 1
        while eng.stats().running == 2:
            await trio.sleep(0.0001)
        freed.append(trio.current_time() - start)

    workload = [
        (0.0, request("victim request", stream=False, rid="victim", max_new_tokens=200)),
        (0.0, request("bystander", stream=False, max_new_tokens=100)),
    ]
    plain, _ = await serve(1, workload, abort_then_watch)
    runs, _ = await serve(RUNS, workload, abort_then_watch)
    for alone, ran in zip(plain, runs, strict=True):
        same_answer(ran, alone)
    assert answer(runs[0])[2]["type"] == "abort"
    assert answer(runs[1])[2]["type"] == "length"
    # The victim's slot was free as soon as without runs: at the next step boundary.
    assert freed[1] == pytest.approx(freed[0])
    assert freed[1] - 0.3333 <= testing.step_time(testing.DEFAULT_SIM_LATENCY, decoding=2)


async def test_closing_the_engine_during_a_run_ends_it_within_a_decode(
    autojump_clock: trio.abc.Clock,
) -> None:
    config = sim_config(max_run_decodes=RUNS)
    async with engine.open_engine(config) as eng:
        stream = eng.submit(request("x", stream=False, max_new_tokens=3000))
        await trio.sleep(0.5)
        closing = trio.current_time()
    assert trio.current_time() - closing <= testing.step_time(
        testing.DEFAULT_SIM_LATENCY, decoding=1
    )
    async with stream:
        items = [item async for item in stream]
    done = items[-1]
    assert isinstance(done, Done)
    assert done.finish_reason["status_code"] == 503
    assert 0 < done.completion_tokens < 3000


def test_max_run_decodes_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="max_run_decodes must be at least 1"):
        EngineConfig(max_run_decodes=0)


async def test_a_commit_that_fails_when_an_abort_hands_over_a_runs_tokens_fails_the_run_only(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An abort mid-run commits what the run decoded first; if that commit fails (a bug), the
    abort still returns, the run ends with the step failure its requests would see from a
    failed decode, and the engine serves on."""
    from tributary.engine.scheduler import Scheduler

    commit_run = Scheduler._commit_run
    aborting = False

    def failing(self: Scheduler, *args: Any) -> None:
        if aborting:
            raise RuntimeError("commit bug")
        commit_run(self, *args)

    monkeypatch.setattr(Scheduler, "_commit_run", failing)

    async def abort_mid_run(eng: engine.Engine, start: float) -> None:
        nonlocal aborting
        await trio.sleep_until(start + 0.3333)
        aborting = True
        try:
            assert eng.abort("victim") == 1  # does not raise
        finally:
            aborting = False

    workload = [
        (0.0, request("victim request", stream=False, rid="victim", max_new_tokens=200)),
        (0.0, request("bystander", stream=False, max_new_tokens=100)),
        (0.5, request("after it", stream=False, max_new_tokens=10)),
    ]
    (victim, bystander, after), stats = await serve(RUNS, workload, abort_mid_run)
    assert answer(victim)[2]["type"] == "abort"  # what its client asked for
    failed = bystander[-1][1]
    assert isinstance(failed, engine.Error) and failed.error.http_status == 500
    assert answer(after)[2]["type"] == "length" and len(answer(after)[1]) == 10
    assert stats.running == 0 and stats.kv_used_cells == 0
