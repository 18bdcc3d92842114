"""`RequestStream.redirect`: the engine hands items to a sink at the moment it produces them
(how a streamed response takes a batch's items without a task per item), on the sim runner
under Trio's autojump clock.
"""

from __future__ import annotations

import pytest
import trio

from tributary import engine, testing
from tributary.engine import Done, Error, Frame, GenerateRequest, SamplingParams, SimLatency

LAT = SimLatency(step_base=0.010, decode_per_seq=0.002, prefill_per_token=0.001)

pytestmark = pytest.mark.tributary_config(sim_latency=LAT)


def request(text: str = "hello", max_new_tokens: int = 4) -> GenerateRequest:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    return GenerateRequest(text=text, sampling=SamplingParams.from_dict(params))


def step_cost(decoding: int = 0, prefill: int = 0) -> float:
    return testing.step_time(LAT, decoding=decoding, prefill=prefill)


async def test_sink_sees_each_item_when_the_engine_produces_it(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    start = trio.current_time()
    seen: list[tuple[float, engine.Output]] = []
    ended = trio.Event()

    def sink(item: engine.Output) -> None:
        seen.append((trio.current_time() - start, item))
        if isinstance(item, Done | Error):
            ended.set()

    stream = tributary_engine.submit(request("hello", max_new_tokens=3))
    stream.redirect(sink)
    await ended.wait()
    first = step_cost(prefill=5)
    assert [t for t, _ in seen] == pytest.approx(
        [first, first + step_cost(1), first + 2 * step_cost(1)]
    )
    assert [type(i) for _, i in seen] == [Frame, Frame, Done]
    assert [tok for _, i in seen for tok in i.output_ids] != []
    # Redirected, the stream is no longer iterated; closing it after the terminal item is
    # not an abort.
    assert [item async for item in stream] == []
    stream.close()
    testing.assert_engine_idle(tributary_engine)


async def test_items_waiting_before_the_redirect_come_first_in_order(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    reference = [item async for item in tributary_engine.submit(request("abc", 6))]
    stream = tributary_engine.submit(request("abc", 6))
    # Let two steps' items queue on the stream before redirecting it.
    await trio.sleep(step_cost(prefill=3) + step_cost(1) + 0.0001)
    seen: list[engine.Output] = []
    stream.redirect(seen.append)
    assert len(seen) == 2  # delivered during redirect, synchronously
    await testing.wait_engine_idle(tributary_engine)
    assert [(type(i), i.output_ids) for i in seen] == [(type(i), i.output_ids) for i in reference]


async def test_closing_a_redirected_stream_before_its_end_aborts_it(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    stream = tributary_engine.submit(request("abc", 1000))
    seen: list[engine.Output] = []
    stream.redirect(seen.append)
    await trio.sleep(step_cost(prefill=3) + 3 * step_cost(1))
    assert seen and not stream.finished
    stream.close()
    # The abort takes effect at the next step boundary; its Done reaches nobody.
    await testing.wait_engine_idle(tributary_engine, timeout=step_cost(1) * 2)
    assert all(isinstance(i, Frame) for i in seen)


async def test_a_truncated_redirected_stream_ends_with_an_error() -> None:
    sender, receiver = engine.open_output_channel("r1")
    aborted: list[str] = []
    stream = engine.RequestStream(
        rid="r1",
        prompt_tokens=1,
        receiver=receiver,
        abort=lambda: aborted.append("r1"),
        sender=sender,
    )
    frame = Frame("r1", "a", [1], 1, 1, 0)
    sender.send(frame)
    seen: list[engine.Output] = []
    stream.redirect(seen.append)
    sender.close()  # no Done or Error: a producer bug, reported rather than hidden
    assert seen[0] is frame
    assert isinstance(seen[1], Error)
    assert isinstance(seen[1].error, engine.RequestTruncated)
    stream.close()
    assert aborted == []  # the stream ended (with an error): nothing left to abort


async def test_a_stream_without_its_sender_cannot_be_redirected() -> None:
    _, receiver = trio.open_memory_channel[engine.Output](1)
    stream = engine.RequestStream(rid="r", prompt_tokens=1, receiver=receiver, abort=lambda: None)
    with pytest.raises(TypeError, match="without its sender"):
        stream.redirect(lambda item: None)


async def test_a_sink_that_raises_does_not_kill_the_scheduler(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    """`sink` must not raise, but a bug in one response body must not take the engine (and
    every other client) down with it."""
    calls = 0

    def sink(item: engine.Output) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("a buggy sink")

    bad = tributary_engine.submit(request("bad", max_new_tokens=20))
    bad.redirect(sink)
    other = [item async for item in tributary_engine.submit(request("other", 5))]
    assert isinstance(other[-1], Done) and calls >= 1
    bad.close()
    await testing.wait_engine_idle(tributary_engine)
    after = [item async for item in tributary_engine.submit(request("after", 3))]
    assert isinstance(after[-1], Done)


class _Schedulings(trio.abc.Instrument):
    """How often one task was scheduled to run (woken) while installed."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.count = 0

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.count += 1


async def test_collect_redirected_wakes_its_caller_once_not_once_per_token(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    """A unary answer of 40 tokens: the callback sees every item at its step's end, and the
    task waiting for the answer is woken once, when the last one arrives."""
    start = trio.current_time()
    seen: list[tuple[float, engine.Output]] = []
    stream = tributary_engine.submit(request("hello", max_new_tokens=40))
    counter = _Schedulings(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(counter)
    try:
        await engine.collect_redirected(
            [stream], lambda _i, item: seen.append((trio.current_time() - start, item)) or False
        )
    finally:
        trio.lowlevel.remove_instrument(counter)
    stream.close()
    assert [type(i) for _, i in seen] == [Frame] * 39 + [Done]
    assert seen[-1][1].completion_tokens == 40
    first = step_cost(prefill=5)
    assert seen[1][0] == pytest.approx(first + step_cost(1))  # at delivery, not at the end
    assert counter.count == 1
    testing.assert_engine_idle(tributary_engine)


async def test_collect_redirected_keeps_each_streams_items_apart_and_ends_with_the_last(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    streams = [tributary_engine.submit(request(t, n)) for t, n in (("a", 3), ("bb", 7), ("c", 1))]
    seen: dict[int, list[engine.Output]] = {0: [], 1: [], 2: []}
    await engine.collect_redirected(streams, lambda i, item: seen[i].append(item) or False)
    assert [len(v) for v in seen.values()] == [3, 7, 1]
    assert all(isinstance(v[-1], Done) for v in seen.values())
    assert [v[-1].completion_tokens for v in seen.values()] == [3, 7, 1]
    for s in streams:
        s.close()
    testing.assert_engine_idle(tributary_engine)


async def test_collect_redirected_stops_when_the_callback_says_so(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    """One choice's failure fails a /v1 response: the wait ends there, and closing the
    streams aborts the others at the next step boundary."""
    short = tributary_engine.submit(request("a", 2))
    long = tributary_engine.submit(request("b", 1000))
    await engine.collect_redirected(
        [short, long], lambda i, item: i == 0 and isinstance(item, Done)
    )
    assert short.finished and not long.finished
    short.close()
    long.close()
    await testing.wait_engine_idle(tributary_engine, timeout=step_cost(1) * 2)


async def test_collect_redirected_ends_a_stream_at_its_deadline_with_a_408(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    quick = tributary_engine.submit(request("a", 3))
    slow = tributary_engine.submit(request("b", 1000))
    deadline = trio.current_time() + 0.5
    slow.set_deadline(deadline)
    last: dict[int, engine.Output] = {}

    def keep(i: int, item: engine.Output) -> bool:
        last[i] = item
        return False

    await engine.collect_redirected([quick, slow], keep)
    assert trio.current_time() == pytest.approx(deadline)
    assert isinstance(last[0], Done) and last[0].finish_reason["type"] == "length"
    assert isinstance(last[1], Done) and last[1].finish_reason["status_code"] == 408
    assert last[1].completion_tokens > 0  # the counts so far
    quick.close()
    slow.close()
    await testing.wait_engine_idle(tributary_engine, timeout=step_cost(1) * 2)


@pytest.mark.parametrize("fails_on", [Frame, Done])
async def test_collect_redirected_raises_a_callbacks_failure_in_its_caller(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock, fails_on: type
) -> None:
    """The callback runs in the scheduler, but its failure is the caller's: it ends the wait
    at once (no hang), nothing more reaches the callback, and the scheduler carries on."""
    seen: list[engine.Output] = []

    def on_item(_index: int, item: engine.Output) -> bool:
        seen.append(item)
        if isinstance(item, fails_on):
            raise RuntimeError("a bug in the consumer")
        return False

    stream = tributary_engine.submit(request("abc", 5))
    with trio.fail_after(10), pytest.raises(RuntimeError, match="a bug in the consumer"):
        await engine.collect_redirected([stream], on_item)
    assert isinstance(seen[-1], fails_on) and len(seen) == (1 if fails_on is Frame else 5)
    stream.close()  # aborts it if it had not ended
    await testing.wait_engine_idle(tributary_engine, timeout=step_cost(1) * 2)
    after = [item async for item in tributary_engine.submit(request("after", 3))]
    assert isinstance(after[-1], Done)


@pytest.mark.parametrize(
    ("deadline", "other_tokens"), [(0.5, 3), (0.5, 150), (None, 3), (None, 150)]
)
async def test_collect_redirected_stops_waiting_for_a_stream_closed_meanwhile(
    tributary_engine: engine.Engine,
    autojump_clock: trio.abc.Clock,
    deadline: float | None,
    other_tokens: int,
) -> None:
    """A stream closed by another task delivers nothing more, not even its 408: the wait
    ends when the other streams have, whatever its deadline."""
    other = tributary_engine.submit(request("a", other_tokens))
    slow = tributary_engine.submit(request("b", 1000))
    start = trio.current_time()
    if deadline is not None:
        slow.set_deadline(start + deadline)
    seen: list[tuple[float, int, engine.Output]] = []

    def keep(i: int, item: engine.Output) -> bool:
        seen.append((trio.current_time() - start, i, item))
        return False

    async def close_slow() -> None:
        await trio.sleep(0.2)
        slow.close()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_slow)
            await engine.collect_redirected([other, slow], keep)
    other_end = max(at for at, i, _ in seen if i == 0)
    assert trio.current_time() - start == pytest.approx(max(other_end, 0.2))
    assert [type(item) for _, i, item in seen if i == 0][-1] is Done
    assert all(at <= 0.2 and type(item) is Frame for at, i, item in seen if i == 1)
    other.close()
    await testing.wait_engine_idle(tributary_engine, timeout=step_cost(1) * 2)
