"""Scheduling, timing and cancellation on the sim runner, under Trio's autojump clock.

Costs come from SimLatency: a step costs base + per decoding sequence + per prefill token, so
every expected time below is computed from the same three numbers the scheduler pays.

Engines come from Tributary's pytest plugin: `tributary_engine`, on LAT here, with a test's
`tributary_config` marker replacing config fields; the tests about opening and closing an
engine open their own.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from tributary import engine, testing
from tributary.engine import (
    Done,
    EngineConfig,
    Error,
    Frame,
    GenerateRequest,
    SamplingParams,
    SimLatency,
)

LAT = SimLatency(step_base=0.010, decode_per_seq=0.002, prefill_per_token=0.001)

pytestmark = pytest.mark.tributary_config(sim_latency=LAT)


def sim_config(**overrides: object) -> EngineConfig:
    return testing.sim_config(**{"sim_latency": LAT, **overrides})


def request(text: str = "hello", **sampling: object) -> GenerateRequest:
    params = {"temperature": 0, "max_new_tokens": 8, **sampling}
    return GenerateRequest(text=text, sampling=SamplingParams.from_dict(params))


def step_cost(decoding: int = 0, prefill: int = 0) -> float:
    return testing.step_time(LAT, decoding=decoding, prefill=prefill)


async def collect(
    stream: engine.RequestStream, into: list[tuple[float, engine.Output]] | None = None
) -> list[tuple[float, engine.Output]]:
    """Read a stream to its end, noting when each item arrived (appending to `into` live)."""
    out = [] if into is None else into
    async with stream:
        async for item in stream:
            out.append((trio.current_time(), item))
    return out


async def test_exact_timing_of_one_request(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    start = trio.current_time()
    items = await collect(eng.submit(request("hello", max_new_tokens=3)))
    times = [t - start for t, _ in items]
    # Step 1 prefills 5 prompt tokens and samples token 1; steps 2-3 decode one token each.
    first = step_cost(prefill=5)
    assert times == pytest.approx([first, first + step_cost(1), first + 2 * step_cost(1)])
    assert [type(i) for _, i in items] == [Frame, Frame, Done]
    done = items[-1][1]
    assert isinstance(done, Done)
    assert done.finish_reason == {"type": "length", "length": 3}
    assert done.completion_tokens == 3 and done.prompt_tokens == 5


async def test_late_request_joins_running_batch_at_next_step(
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    eng = tributary_engine
    long = eng.submit(request("aaaa", max_new_tokens=40))
    late_items: list[tuple[float, engine.Output]] = []
    long_items: list[tuple[float, engine.Output]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(collect, long, long_items)
        # Let the long request produce 5 tokens; the scheduler is then inside step 6.
        while len(long_items) < 5:
            await trio.sleep(0.001)
        await trio.testing.wait_all_tasks_blocked()
        submitted = trio.current_time()
        late_items = await collect(eng.submit(request("bb", max_new_tokens=2)))
    # The step in flight ends (one decode), then the next step prefills the late prompt
    # alongside the long decode.
    long_times = [t for t, _ in long_items]
    step6_end = long_times[5]
    assert late_items[0][0] == pytest.approx(step6_end + step_cost(decoding=1, prefill=2))
    assert late_items[0][0] - submitted < 2 * step_cost(decoding=1, prefill=2)
    # The late request finished long before the long one: nobody waits for anyone.
    assert late_items[-1][0] < long_items[-1][0]
    # And the long request got a token in every step, the joint ones included.
    gaps = [b - a for a, b in itertools.pairwise(long_times)]
    assert max(gaps) == pytest.approx(step_cost(decoding=1, prefill=2))
    assert len(long_items) == 40


@pytest.mark.parametrize("budget", [256, 4096])
async def test_long_prompt_stalls_decodes_by_at_most_one_chunk(
    autojump_clock: trio.abc.Clock, budget: int
) -> None:
    """Whatever the step's prefill budget: it decides how many prompts start together,
    never how one prompt is cut."""
    chunk = 256
    config = sim_config(prefill_chunk_tokens=chunk, max_prefill_tokens=budget)
    async with engine.open_engine(config) as eng:
        decoder = eng.submit(request("x", max_new_tokens=60))
        decoded: list[tuple[float, engine.Output]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, decoder, decoded)
            while len(decoded) < 3:
                await trio.sleep(0.001)
            big = eng.submit(request("y" * 2000, max_new_tokens=1))
            big_items = await collect(big)
    times = [t for t, _ in decoded]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    one_chunk_step = step_cost(decoding=1, prefill=chunk)
    assert max(gaps) == pytest.approx(one_chunk_step)
    # The 2,000-token prompt took ceil(2000 / 256) = 8 steps, each one also a decode step.
    assert sum(1 for g in gaps if g > 1.5 * step_cost(decoding=1)) == math.ceil(2000 / chunk)
    assert isinstance(big_items[-1][1], Done)
    assert big_items[-1][1].prompt_tokens == 2000


async def burst_times(config: EngineConfig, n: int = 16, *, tokens: int = 8) -> list[list[float]]:
    """Submit n 60-token prompts at once; when each of their tokens came, per request."""
    items: list[list[tuple[float, engine.Output]]] = [[] for _ in range(n)]
    async with engine.open_engine(config) as eng:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                stream = eng.submit(request(chr(65 + i) * 60, max_new_tokens=tokens))
                nursery.start_soon(collect, stream, items[i])
    return [[t - start for t, item in got if isinstance(item, engine.Frame)] for got in items]


@pytest.mark.parametrize("budget", [256, 1024])
async def test_a_burst_of_prompts_starts_within_the_prefill_budget(
    autojump_clock: trio.abc.Clock, budget: int
) -> None:
    """Sixteen 60-token prompts arriving at once: with a 256-token budget they start four
    at a time, a step apart, and those that start first wait for the rest to start before
    decoding (a burst), so the last first token comes after four prefill steps and nothing
    else; with 1,024 all sixteen get their first token from one step."""
    config = sim_config(max_running_requests=16, max_prefill_tokens=budget)
    times = await burst_times(config)
    first_token = [t[0] for t in times]
    if budget == 1024:
        assert first_token == [pytest.approx(step_cost(prefill=960))] * 16
        return
    waves = sorted(set(first_token))
    assert len(waves) == 4 and all(first_token.count(w) == 4 for w in waves)
    assert waves == [pytest.approx(k * step_cost(prefill=240)) for k in (1, 2, 3, 4)]
    # Then all sixteen decode together: every second token comes from one step.
    assert all(t[1] == pytest.approx(waves[-1] + step_cost(decoding=16)) for t in times)


async def test_without_the_burst_hold_early_starters_decode_beside_the_rest(
    autojump_clock: trio.abc.Clock,
) -> None:
    """`burst_prefill_tokens=0`: the first four decode beside the next prompts' prefill, so
    they stream sooner and the last first token comes later (three steps carry decodes)."""
    config = sim_config(max_running_requests=16, burst_prefill_tokens=0)
    times = await burst_times(config)
    first_token = sorted(t[0] for t in times)
    prefill = step_cost(prefill=240)
    assert first_token[0] == pytest.approx(prefill)
    joint = [step_cost(decoding=d, prefill=240) for d in (4, 8, 12)]
    assert first_token[-1] == pytest.approx(prefill + sum(joint))
    assert first_token[-1] > 4 * prefill
    early = [t for t in times if t[0] == pytest.approx(prefill)]
    assert len(early) == 4
    assert all(t[1] == pytest.approx(prefill + joint[0]) for t in early)


async def test_a_burst_holds_its_decodes_only_up_to_its_token_limit(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Sixteen 60-token prompts hold 960 tokens: over a limit of 959 they are no burst and
    decode as soon as each has a first token, as with the hold off."""
    over = await burst_times(sim_config(max_running_requests=16, burst_prefill_tokens=959))
    off = await burst_times(sim_config(max_running_requests=16, burst_prefill_tokens=0))
    assert list(itertools.chain(*over)) == pytest.approx(list(itertools.chain(*off)))
    at = await burst_times(sim_config(max_running_requests=16, burst_prefill_tokens=960))
    assert max(t[0] for t in at) < max(t[0] for t in off)


async def test_a_fork_of_an_earlier_long_prompt_holds_no_burst(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A sample that forks a 3,000-token prompt admitted a step earlier waits for that
    prefill, which the burst's limit never counted: the short prompts admitted with it
    decode as soon as they have their first token instead of waiting through it."""
    config = sim_config(max_running_requests=4, max_prefill_tokens=1024)
    long = "L" * 3000
    async with engine.open_engine(config) as eng:
        leader: list[tuple[float, engine.Output]] = []
        short: list[list[tuple[float, engine.Output]]] = [[], []]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, eng.submit(request(long, max_new_tokens=2)), leader)
            await trio.sleep(0.001)  # the leader's first chunk is running
            nursery.start_soon(collect, eng.submit(request(long, max_new_tokens=2)))
            for i in range(2):
                stream = eng.submit(request(chr(65 + i) * 60, max_new_tokens=3))
                nursery.start_soon(collect, stream, short[i])
    leader_first = leader[0][0]
    for items in short:
        frames = [t for t, item in items if isinstance(item, engine.Frame)]
        assert frames[1] < leader_first  # decoding while the long prompt still prefilled


async def test_requests_running_before_a_burst_keep_decoding_beside_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The hold is a burst's own: a request admitted earlier gets a token in every step
    while the burst prefills, and the burst's early starters still wait for the rest."""
    config = sim_config(max_running_requests=16)
    async with engine.open_engine(config) as eng:
        decoded: list[tuple[float, engine.Output]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, eng.submit(request("x", max_new_tokens=30)), decoded)
            while len(decoded) < 3:
                await trio.sleep(0.001)
            results: list[list[tuple[float, engine.Output]]] = [[] for _ in range(8)]
            for i in range(8):
                stream = eng.submit(request(chr(65 + i) * 60, max_new_tokens=3))
                nursery.start_soon(collect, stream, results[i])
    times = [t for t, _ in decoded]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Two prefill steps of four prompts each ran beside the earlier request's decode.
    assert max(gaps) == pytest.approx(step_cost(decoding=1, prefill=240))
    assert sum(1 for g in gaps if g == pytest.approx(step_cost(decoding=1, prefill=240))) == 2
    frames = [[t for t, item in r if isinstance(item, engine.Frame)] for r in results]
    last_first = max(f[0] for f in frames)
    assert all(f[1] > last_first for f in frames)


def test_a_prefill_budget_smaller_than_a_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_prefill_tokens .* must be at least"):
        EngineConfig(prefill_chunk_tokens=256, max_prefill_tokens=128)
    # Unset, the budget is one chunk.
    assert EngineConfig(prefill_chunk_tokens=4096).prefill_budget == 4096


@pytest.mark.tributary_config(max_running_requests=1, max_queued_requests=2)
async def test_queue_full_is_typed_and_recovers(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    # One takes the free slot, two wait: the engine is full.
    accepted = [eng.submit(request(max_new_tokens=4)) for _ in range(3)]
    with pytest.raises(engine.QueueFull) as info:
        eng.submit(request())
    assert info.value.http_status == 503
    await trio.testing.wait_all_tasks_blocked()
    assert eng.stats().running == 1 and eng.stats().waiting == 2
    with pytest.raises(engine.QueueFull):
        eng.submit(request())
    # Once the queue drains, submitting works again.
    for stream in accepted:
        assert isinstance((await collect(stream))[-1][1], Done)
    third = await collect(eng.submit(request(max_new_tokens=2)))
    assert isinstance(third[-1][1], Done)


async def test_leaving_stream_early_aborts_and_frees_the_sequence(
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    eng = tributary_engine
    other = eng.submit(request("other", max_new_tokens=30))
    leaver = eng.submit(request("leaver", max_new_tokens=30))
    other_items: list[tuple[float, engine.Output]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(collect, other, other_items)
        async with leaver:
            async for item in leaver:
                if item.completion_tokens == 3:  # type: ignore[union-attr]
                    break
        # Within one step the leaver's sequence is gone and its KV cells are free
        # ("leaver" would hold at least 6 + 3 cells).
        await trio.sleep(step_cost(decoding=2) * 1.01)
        stats = eng.stats()
        assert stats.running == 1
        other_cells = len("other") + len(other_items)
        assert other_cells - 1 <= stats.kv_used_cells <= other_cells
    assert eng.stats().running == 0 and eng.stats().kv_used_cells == 0
    done = other_items[-1][1]
    assert isinstance(done, Done) and done.finish_reason["type"] == "length"
    assert done.completion_tokens == 30


async def test_cancelled_consumer_aborts(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    with trio.move_on_after(0.1):
        await collect(eng.submit(request(max_new_tokens=1000)))
    await trio.sleep(step_cost(decoding=1))
    assert eng.stats().running == 0
    assert eng.stats().kv_used_cells == 0


@pytest.mark.tributary_config(max_running_requests=1)
async def test_abort_by_rid_ends_stream_with_abort_reason(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    running = eng.submit(
        GenerateRequest(text="r", rid="run-1", sampling=SamplingParams.from_dict({}))
    )
    queued = eng.submit(GenerateRequest(text="q", rid="queued-1"))
    async with running:
        await running.__anext__()
        assert eng.abort("run-1") == 1
        assert eng.abort("queued", fanout=True) == 0  # a shared prefix is not a family
        assert eng.abort("queued-1", fanout=True) == 1
        rest = [item async for item in running]
    running_done = rest[-1]
    assert isinstance(running_done, Done)
    assert running_done.finish_reason["type"] == "abort"
    assert running_done.finish_reason["message"] == "Aborted"
    queued_items = await collect(queued)
    assert queued_items[-1][1].finish_reason == {  # type: ignore[union-attr]
        "type": "abort",
        "message": "Abort in waiting queue",
        "status_code": None,
        "err_type": None,
    }
    # The rid is free again once the request has ended.
    assert eng.abort("run-1") == 0
    again = await collect(eng.submit(request(max_new_tokens=1)))
    assert isinstance(again[-1][1], Done)


async def test_duplicate_in_flight_rid_is_rejected(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    first = eng.submit(GenerateRequest(text="a", rid="same"))
    with pytest.raises(engine.DuplicateRequestId, match="Duplicate request ID"):
        eng.submit(GenerateRequest(text="b", rid="same"))
    await collect(first)
    # Sequential reuse is fine.
    await collect(eng.submit(GenerateRequest(text="c", rid="same")))


@pytest.mark.tributary_config(sim_fail_at_step=3)
async def test_runner_failure_fails_its_batch_and_engine_keeps_serving(
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    eng = tributary_engine
    a = eng.submit(request("a", max_new_tokens=10))
    b = eng.submit(request("b", max_new_tokens=10))
    for items in (await collect(a), await collect(b)):
        last = items[-1][1]
        assert isinstance(last, Error)
        assert last.error.http_status == 500
        assert "injected failure at step 3" in last.error.message
    assert eng.stats().running == 0 and eng.stats().kv_used_cells == 0
    after = await collect(eng.submit(request("c", max_new_tokens=2)))
    assert isinstance(after[-1][1], Done)


@pytest.mark.tributary_config(context_length=64)
async def test_context_checks_use_sglang_messages(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    with pytest.raises(engine.ContextLengthExceeded) as info:
        eng.submit(request("z" * 64))
    assert info.value.message == (
        "The input (64 tokens) is longer than the model's context length (64 tokens)."
    )
    with pytest.raises(engine.ContextLengthExceeded, match="You requested a total of 70"):
        eng.submit(request("z" * 60, max_new_tokens=10))
    # max_new_tokens null means "until the context is full".
    items = await collect(eng.submit(request("z" * 60, max_new_tokens=None)))
    assert items[-1][1].completion_tokens == 4  # type: ignore[union-attr]


@pytest.mark.tributary_config(stream_interval=4)
async def test_stream_interval_batches_frames(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    items = await collect(eng.submit(request(max_new_tokens=10)))
    outputs = [i for _, i in items]
    assert [len(o.output_ids) for o in outputs] == [4, 4, 2]  # type: ignore[union-attr]
    assert [o.completion_tokens for o in outputs] == [4, 8, 10]  # type: ignore[union-attr]


async def test_stop_token_id_and_string(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    free = await collect(eng.submit(request("seed", max_new_tokens=12)))
    ids = [t for _, o in free for t in o.output_ids]  # type: ignore[union-attr]
    text = "".join(o.text for _, o in free)  # type: ignore[union-attr]
    stop_id = ids[5]
    first = ids.index(stop_id)
    by_id = await collect(eng.submit(request("seed", max_new_tokens=12, stop_token_ids=[stop_id])))
    done = by_id[-1][1]
    assert isinstance(done, Done)
    assert done.finish_reason == {"type": "stop", "matched": stop_id}
    assert done.completion_tokens == first + 1  # the stop token is counted ...
    joined = "".join(o.text for _, o in by_id)  # type: ignore[union-attr]
    assert joined == text[:first]  # ... but not rendered
    stop_str = text[6:8]
    by_str = await collect(eng.submit(request("seed", max_new_tokens=12, stop=[stop_str])))
    joined = "".join(o.text for _, o in by_str)  # type: ignore[union-attr]
    assert joined == text[: text.index(stop_str)]
    assert by_str[-1][1].finish_reason == {"type": "stop", "matched": stop_str}  # type: ignore[union-attr]


async def test_min_new_tokens_suppresses_eos(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    # logit_bias forces EOS (id 2) on the sim runner, as +100 would on a real model.
    eng = tributary_engine
    eager = await collect(eng.submit(request(logit_bias={"2": 100})))
    assert eager[-1][1].completion_tokens == 1  # type: ignore[union-attr]
    assert eager[-1][1].finish_reason == {"type": "stop", "matched": 2}  # type: ignore[union-attr]
    held = await collect(eng.submit(request(logit_bias={"2": 100}, min_new_tokens=5)))
    assert held[-1][1].completion_tokens == 6  # type: ignore[union-attr]
    ignored = await collect(
        eng.submit(request(logit_bias={"2": 100}, ignore_eos=True, max_new_tokens=7))
    )
    assert ignored[-1][1].finish_reason == {"type": "length", "length": 7}  # type: ignore[union-attr]


async def test_engine_exit_aborts_in_flight_requests(autojump_clock: trio.abc.Clock) -> None:
    async with engine.open_engine(sim_config()) as eng:
        stream = eng.submit(request(max_new_tokens=1000))
        first = await stream.__anext__()
        assert isinstance(first, Frame)
    with pytest.raises(engine.EngineClosed):
        eng.submit(request())
    # Read after the engine closed, the stream ends with a 503 abort, not silence.
    rest = [item async for item in stream]
    stream.close()
    last = rest[-1]
    assert isinstance(last, Done)
    assert last.finish_reason["type"] == "abort"
    assert last.finish_reason["status_code"] == 503


async def test_error_in_block_reaches_caller_unwrapped(autojump_clock: trio.abc.Clock) -> None:
    with pytest.raises(KeyError):
        async with engine.open_engine(sim_config()):
            raise KeyError("mine")


async def test_closing_a_generator_around_the_stream_aborts(
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    """The abort also runs when cleanup sees GeneratorExit (a closed async generator), as
    happens to a streaming HTTP body whose client stopped reading."""
    eng = tributary_engine

    async def frames() -> AsyncIterator[engine.Output]:
        async with eng.submit(request(max_new_tokens=1000)) as stream:
            async for item in stream:
                yield item

    agen = frames()
    await agen.__anext__()
    assert eng.stats().running == 1
    await agen.aclose()
    await trio.sleep(step_cost(decoding=1) * 1.01)
    assert eng.stats().running == 0 and eng.stats().kv_used_cells == 0


@pytest.mark.tributary_config(prefill_chunk_tokens=8, sim_fail_at_step=1)
async def test_runner_failure_spares_sequences_outside_the_failed_step(
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    # An 8-token prefill budget: step 1 holds only the first prompt, and step 1 fails.
    eng = tributary_engine
    in_step = eng.submit(request("a" * 8, max_new_tokens=4))
    waiting_for_budget = eng.submit(request("b" * 8, max_new_tokens=4))
    failed = (await collect(in_step))[-1][1]
    spared = (await collect(waiting_for_budget))[-1][1]
    assert isinstance(failed, Error) and failed.error.http_status == 500
    assert isinstance(spared, Done) and spared.completion_tokens == 4


@pytest.mark.tributary_config(sim_fail_at_step=2)
async def test_an_abort_in_a_failing_step_keeps_its_own_status(
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    """A request aborted (here with a status, as a graceful shutdown does) while the step it
    is in fails gets its abort, not the step's 500; the other sequence in that step fails."""
    eng = tributary_engine
    aborted = eng.submit(dataclasses.replace(request(max_new_tokens=50), rid="a"))
    other = eng.submit(dataclasses.replace(request(max_new_tokens=50), rid="b"))
    assert isinstance(await aborted.__anext__(), Frame)  # step 1 committed
    await trio.testing.wait_all_tasks_blocked()  # the scheduler is inside step 2 now
    assert eng._runner.steps == 2  # type: ignore[attr-defined]
    eng.abort("a", message="The server is shutting down.", status_code=503)
    last = (await collect(aborted))[-1][1]
    failed = (await collect(other))[-1][1]
    assert isinstance(last, Done), last
    assert last.finish_reason["status_code"] == 503
    assert last.finish_reason["message"] == "The server is shutting down."
    assert isinstance(failed, Error) and failed.error.http_status == 500
    await testing.wait_engine_idle(eng)


async def test_a_stream_deadline_ends_it_at_the_deadline_with_a_408_abort(
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    """The deadline is exact (mid-step: here a prefill chunk of 256 tokens takes 0.28 s), the
    stream ends with the 408 abort and the counts so far, the sequence is freed by the next
    step boundary, and a request beside it carries on."""
    eng = tributary_engine
    start = trio.current_time()
    late = eng.submit(request("x" * 2000, max_new_tokens=10))
    beside = eng.submit(request("hello", max_new_tokens=3))
    late.set_deadline(start + 0.1, message="Request timed out after 0.1 s.")
    items = await collect(late)
    at, last = items[-1]
    assert at == pytest.approx(start + 0.1)
    assert isinstance(last, Done)
    assert last.finish_reason == {
        "type": "abort",
        "message": "Request timed out after 0.1 s.",
        "status_code": 408,
        "err_type": "timeout",
    }
    assert (last.prompt_tokens, last.completion_tokens) == (2000, 0)
    done = (await collect(beside))[-1][1]
    assert isinstance(done, Done) and done.completion_tokens == 3
    await testing.wait_engine_idle(eng)


async def test_parallel_samples_are_the_callers_to_expand(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    with pytest.raises(engine.BadRequest, match="submit n requests"):
        eng.submit(request(n=3))
    assert eng.stats().waiting == 0


async def test_a_rid_is_free_again_as_soon_as_its_request_is_aborted(
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    """A client that gave up may retry with the same rid at once, before the next step
    boundary has reaped the old sequence."""
    eng = tributary_engine
    first = eng.submit(GenerateRequest(text="a", rid="again"))
    async with first:
        await first.__anext__()
    retry = await collect(eng.submit(GenerateRequest(text="a", rid="again")))
    assert isinstance(retry[-1][1], Done)


async def test_huge_and_non_finite_numbers_are_rejected() -> None:
    with pytest.raises(engine.InvalidSamplingParams, match="out of range"):
        SamplingParams.from_dict({"temperature": 10**400})
    for bad in (float("nan"), float("inf"), 10**400):
        with pytest.raises(engine.InvalidSamplingParams, match="logit_bias"):
            SamplingParams.from_dict({"logit_bias": {"5": bad}})


@pytest.mark.tributary_config(context_length=64)
async def test_length_limit_comes_before_min_new_tokens(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    """max_new_tokens null + a min_new_tokens beyond the context: the request stops at the
    context, and the sequence beside it is untouched."""
    eng = tributary_engine
    greedy_run = eng.submit(request("hello", max_new_tokens=None, min_new_tokens=200))
    neighbour = eng.submit(request("other", max_new_tokens=20))
    done = (await collect(greedy_run))[-1][1]
    beside = (await collect(neighbour))[-1][1]
    assert isinstance(done, Done)
    assert done.finish_reason == {"type": "length", "length": 64 - 5}
    assert isinstance(beside, Done) and beside.completion_tokens == 20


async def test_stop_string_on_the_last_allowed_token_is_plain_text(
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    eng = tributary_engine
    free = await collect(eng.submit(request("seed", max_new_tokens=8)))
    text = "".join(o.text for _, o in free)  # type: ignore[union-attr]
    stop = text[6:8]  # completed by token 8, the last one allowed
    assert stop not in text[:7]
    items = await collect(eng.submit(request("seed", max_new_tokens=8, stop=[stop])))
    assert items[-1][1].finish_reason == {"type": "length", "length": 8}  # type: ignore[union-attr]
    assert "".join(o.text for _, o in items) == text  # type: ignore[union-attr]


async def test_min_new_tokens_gates_stop_strings_the_same_way_whatever_else_is_set(
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
) -> None:
    eng = tributary_engine
    free = await collect(eng.submit(request("seed", max_new_tokens=30)))
    text = "".join(o.text for _, o in free)  # type: ignore[union-attr]
    # A character that appears among the first 3 tokens and again later.
    char = next(c for c in text[:3] if c in text[3:])
    later = text.index(char, 3)  # the first occurrence at token index >= 3
    results = []
    for stops in ([char], [char, "an unrelated much longer stop string"]):
        items = await collect(
            eng.submit(request("seed", max_new_tokens=30, stop=stops, min_new_tokens=3))
        )
        results.append(("".join(o.text for _, o in items), items[-1][1].finish_reason))  # type: ignore[union-attr]
    assert results[0] == results[1]
    assert results[0] == (text[:later], {"type": "stop", "matched": char})


async def test_the_model_is_not_touched_after_the_engine_closed(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with engine.open_engine(sim_config()) as eng:
        pass
    for call in (lambda: eng.tokenize("hi"), lambda: eng.detokenize([70, 71])):
        with pytest.raises(engine.EngineClosed):
            call()


@pytest.mark.parametrize(
    "setting",
    [
        {"max_running_requests": 0},
        {"prefill_chunk_tokens": 0},
        {"max_queued_requests": -1},
        {"stream_interval": 0},
        {"threads": 0},
    ],
)
def test_config_values_that_would_hang_are_refused(setting: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be at least"):
        EngineConfig(**setting)  # type: ignore[arg-type]


@pytest.mark.tributary_config(max_running_requests=1, prefix_cache_mb=0)  # (both prefill)
async def test_done_says_when_the_request_was_admitted_and_its_first_token_sampled(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    start = trio.current_time()
    first = tributary_engine.submit(request(max_new_tokens=3))
    second = tributary_engine.submit(request(max_new_tokens=3))
    one = step_cost(prefill=5) + 2 * step_cost(decoding=1)  # "hello", 3 tokens, alone
    async with trio.open_nursery() as nursery:
        results: list[list[tuple[float, engine.Output]]] = [[], []]
        nursery.start_soon(collect, first, results[0])
        nursery.start_soon(collect, second, results[1])
    for i, items in enumerate(results):
        done = items[-1][1]
        assert isinstance(done, Done)
        assert done.admitted_at == pytest.approx(start + i * one)  # one slot: FIFO
        assert done.first_token_at == pytest.approx(start + i * one + step_cost(prefill=5))
        assert items[0][0] == pytest.approx(done.first_token_at)  # the first Frame's arrival


async def test_a_request_aborted_while_waiting_was_never_admitted(
    tributary_engine: engine.Engine,
) -> None:
    params = SamplingParams.from_dict({"max_new_tokens": 0})
    stream = tributary_engine.submit(GenerateRequest(text="hi", sampling=params))
    stream.close()
    assert tributary_engine.stats().aborted_requests == 1
    [done] = await testing.collect(tributary_engine.submit(request(max_new_tokens=0)))
    assert isinstance(done, Done) and done.first_token_at is None and done.admitted_at is not None
