"""The `ComputeThread` (engine/compute_thread.py) outlives its jobs: a failed job, and a
result whose Trio run ended before it arrived (Ctrl-C during a model load), leave it
serving; a result nobody collects is freed.

These tests call `trio.run` themselves, twice in one process, and deliver a real SIGINT to
the main thread while a job runs, as Ctrl-C in an embedding program does."""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import outcome
import pytest
import trio

from tributary import engine
from tributary.engine import Done, EngineConfig, GenerateRequest, SamplingParams
from tributary.engine import compute_thread as compute
from tributary.engine.compute_thread import ComputeThread
from tributary.engine.runners import llama

#: How long a second `trio.run` may take before the test calls it hung (a dead compute
#: thread makes it wait for ever: its wait is shielded, so no deadline inside it helps).
HANG = 60.0

needs_default_sigint = pytest.mark.skipif(
    signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
    reason="Trio only turns SIGINT into KeyboardInterrupt over Python's default handler",
)


def ctrl_c() -> None:
    """SIGINT for the main thread, from any thread (Trio's handler runs there)."""
    main = threading.main_thread().ident
    assert main is not None
    signal.pthread_kill(main, signal.SIGINT)


def run_in_thread(fn: Callable[[], Any]) -> list[Any]:
    """`fn()` in a thread of its own; fails the test if it does not return within HANG."""
    results: list[Any] = []
    worker = threading.Thread(target=lambda: results.append(fn()), daemon=True)
    worker.start()
    worker.join(HANG)
    assert not worker.is_alive(), "hung: the compute thread no longer runs jobs"
    return results


@needs_default_sigint
def test_a_result_whose_caller_was_interrupted_is_freed_and_the_thread_serves_on() -> None:
    thread = ComputeThread()
    run_over = threading.Event()
    freed: list[str] = []

    def slow_job() -> str:
        ctrl_c()
        run_over.wait(HANG)  # the result arrives after its trio.run has ended
        return "model"

    async def interrupted() -> None:
        await thread.run(slow_job, orphan=freed.append)

    with pytest.raises(KeyboardInterrupt):
        trio.run(interrupted)
    # The caller's wakeup fd is closed now, so one of these reuses its number.
    probes = [os.eventfd(0) for _ in range(256)]
    run_over.set()

    async def later() -> int:
        return await thread.run(lambda: 42)

    assert run_in_thread(lambda: trio.run(later)) == [42]
    assert freed == ["model"]
    assert not any(map(readable, probes)), "a wake for the caller that left reached another fd"
    for fd in probes:
        os.close(fd)


def test_a_caller_that_leaves_after_its_wake_frees_the_result_and_never_pools_the_fd() -> None:
    # KeyboardInterrupt reaching a caller just after the compute thread woke it: Trio
    # delivers it through its own queue, after the wake, so this is driven directly.
    thread = ComputeThread()
    wakeup = compute._Wakeup.take()
    handoff: compute._Handoff[str] = compute._Handoff(wakeup)
    assert handoff.deliver(outcome.Value("model"))
    assert readable(wakeup._eventfd)  # type: ignore[arg-type]
    freed: list[str] = []
    thread._leave(handoff, wakeup, freed.append)
    thread.wait_idle()
    assert freed == ["model"]
    assert wakeup not in compute._Wakeup._pool  # a later call would wake at once
    with pytest.raises(OSError):
        os.fstat(wakeup._eventfd)  # type: ignore[arg-type]
    assert not handoff.deliver(outcome.Value("late"))  # nothing reaches it any more


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_a_job_that_raises_anything_leaves_the_thread_serving() -> None:
    thread = ComputeThread()

    def exits() -> None:
        raise SystemExit(3)

    thread.submit(exits)

    async def later() -> int:
        with pytest.raises(KeyboardInterrupt):
            await thread.run(_raise_keyboard_interrupt)  # a failure travels to its caller
        return await thread.run(lambda: 7)

    assert run_in_thread(lambda: trio.run(later)) == [7]


def test_a_failed_job_is_logged_under_the_llama_logger(caplog: pytest.LogCaptureFixture) -> None:
    """The compute thread's lines keep the logger name they had when the thread lived in
    the llama runner: log filters select by it."""
    thread = ComputeThread()

    def fails() -> None:
        raise RuntimeError("decode bug")

    with caplog.at_level(logging.ERROR, logger="tributary.engine.llama"):
        thread.submit(fails)
        thread.wait_idle()
    [logged] = [r for r in caplog.records if "compute thread job" in r.getMessage()]
    assert logged.name == "tributary.engine.llama"
    assert logged.getMessage() == "compute thread job fails failed"


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


@pytest.mark.model
@needs_default_sigint
def test_ctrl_c_during_a_model_load_frees_it_and_a_second_open_engine_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = EngineConfig(context_length=256, max_running_requests=1, threads=1)
    real_load = llama.LlamaRunner.load
    run_over = threading.Event()
    interrupted_loads: list[llama.LlamaRunner] = []

    def load_during_ctrl_c(config: EngineConfig) -> llama.LlamaRunner:
        ctrl_c()
        run_over.wait(HANG)  # the load finishes after the interrupted trio.run has ended
        runner = real_load(config)
        interrupted_loads.append(runner)
        return runner

    async def interrupted() -> None:
        async with engine.open_engine(config):
            pytest.fail("the load was interrupted; the block never runs")

    monkeypatch.setattr(llama.LlamaRunner, "load", load_during_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        trio.run(interrupted)
    monkeypatch.setattr(llama.LlamaRunner, "load", real_load)
    run_over.set()

    async def second() -> Done:
        async with engine.open_engine(config) as eng:
            params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 4})
            async with eng.submit(GenerateRequest(text="Hi", sampling=params)) as stream:
                items = [item async for item in stream]
        assert isinstance(items[-1], Done)
        return items[-1]

    (done,) = run_in_thread(lambda: trio.run(second))
    assert done.completion_tokens == 4
    # The model loaded for nobody was freed on the compute thread (not leaked).
    deadline = time.monotonic() + HANG
    while not interrupted_loads[0]._closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert interrupted_loads[0]._closed


def test_a_cancelled_caller_still_gets_the_result_and_is_cancelled_at_its_next_checkpoint() -> None:
    thread = ComputeThread()
    release = threading.Event()
    ran: list[str] = []

    def slow_job() -> int:
        release.wait(HANG)
        ran.append("job")
        return 5

    async def main() -> tuple[list[object], bool]:
        got: list[object] = []
        with trio.CancelScope() as scope:
            scope.cancel()  # the call is never abandoned: the model is not freed under it
            threading.Timer(0.05, release.set).start()
            got.append(await thread.run(slow_job))
            await trio.lowlevel.checkpoint()
            got.append("went on after cancellation")
        return got, scope.cancelled_caught

    assert run_in_thread(lambda: trio.run(main)) == [([5], True)]
    assert ran == ["job"]


def test_calls_reuse_their_wakeup_descriptors() -> None:
    thread = ComputeThread()

    async def main() -> int:
        for _ in range(5):  # the pool holds what earlier tests left
            await thread.run(lambda: None)
        before = len(os.listdir("/proc/self/fd"))
        for i in range(200):
            assert await thread.run(lambda i=i: i * 2) == i * 2
        return len(os.listdir("/proc/self/fd")) - before

    assert run_in_thread(lambda: trio.run(main)) == [0]


def test_a_feed_that_fails_when_called_from_another_task_fails_the_call() -> None:
    """What a job publishes can be fed at once from another task (`published`: an abort
    hands over a run's decoded tokens). A feed that fails there raises nothing in that
    task: the job is interrupted, what it publishes afterwards is dropped, and the error is
    raised by the call."""
    thread = ComputeThread()
    fed: list[list[int]] = []
    published_one = threading.Event()
    interrupted = threading.Event()

    def job(publish: Callable[[int, bool], int]) -> str:
        publish(1, False)  # no wake: only the other task's call feeds it
        published_one.set()
        assert interrupted.wait(HANG)
        publish(2, True)  # after the failure: dropped
        return "ended"

    def feed(items: list[int]) -> None:
        fed.append(items)
        raise RuntimeError("feed bug")

    async def main() -> int:
        exposed: list[Callable[[], None]] = []

        async def abort_meanwhile() -> None:
            await trio.to_thread.run_sync(published_one.wait)
            exposed[0]()  # the feed fails, but not here
            assert interrupted.is_set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(abort_meanwhile)
            with pytest.raises(RuntimeError, match="feed bug"):
                await thread.run(
                    job, feed=feed, interrupt=interrupted.set, published=exposed.append
                )
        assert fed == [[1]]
        return await thread.run(lambda: 7)  # the thread serves on

    assert run_in_thread(lambda: trio.run(main)) == [7]
