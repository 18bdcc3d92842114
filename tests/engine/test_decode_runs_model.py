"""Decode runs on the real model: the llama runner decodes a run's tokens back to back on its
compute thread, and they are the tokens single steps give, through requests that arrive,
end (a stop string found after the decode that made it, a length), are aborted mid-run and
sample at a temperature; every KV cell comes back and the engine serves on."""

from __future__ import annotations

import time

import pytest
import trio

from tributary import engine
from tributary.engine import Done, EngineConfig, GenerateRequest, SamplingParams

pytestmark = pytest.mark.model

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "Tell me a story about a lighthouse keeper.",
    "Explain how rain forms.",
    "Write a poem about autumn leaves.",
    "Describe a busy market.",
]


def request(i: int, *, stream: bool, rid: str | None = None, **sampling: object) -> GenerateRequest:
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True, **sampling}
    return GenerateRequest(
        text=CHAT.format(QUESTIONS[i % len(QUESTIONS)]),
        sampling=SamplingParams.from_dict(params),
        stream=stream,
        rid=rid,
    )


async def workload(
    max_run: int, stop: str | None, *, overlap: bool = True
) -> tuple[list[list[int]], list[str], list[int]]:
    """A unary and a streamed request from the start, a seeded one with penalties joining
    mid-run, a victim aborted after its tenth token, and a unary one with a stop string."""
    config = EngineConfig(
        context_length=1024,
        max_running_requests=4,
        threads=2,
        max_run_decodes=max_run,
        overlap_decode=overlap,
    )
    reqs = [
        (0.0, request(0, stream=False)),
        (0.0, request(1, stream=True, max_new_tokens=30)),
        (
            0.15,
            request(2, stream=False, temperature=0.9, sampling_seed=11, repetition_penalty=1.2),
        ),
        (0.0, request(3, stream=False, rid="victim", max_new_tokens=400)),
        (0.3, request(0, stream=False, stop=[stop] if stop else None, max_new_tokens=60)),
    ]
    ids: list[list[int]] = [[] for _ in reqs]
    reasons: list[str] = [""] * len(reqs)
    frames = [0] * len(reqs)
    async with engine.open_engine(config) as eng:

        async def client(i: int, at: float, req: GenerateRequest) -> None:
            await trio.sleep(at)
            async with eng.submit(req) as stream:
                async for item in stream:
                    assert not isinstance(item, engine.Error), item.error
                    ids[i] += item.output_ids
                    frames[i] += 1
                    if isinstance(item, Done):
                        reasons[i] = item.finish_reason["type"]

        async def abort_victim() -> None:
            while len(ids[3]) < 10 and not reasons[3]:
                await trio.sleep(0.005)
            eng.abort("victim")

        async with trio.open_nursery() as nursery:
            for i, (at, req) in enumerate(reqs):
                nursery.start_soon(client, i, at, req)
            nursery.start_soon(abort_victim)
        with trio.fail_after(10):
            while eng.stats().running or eng.stats().kv_used_cells:
                await trio.sleep(0.01)
    return ids, reasons, frames


async def test_runs_give_the_tokens_steps_give_and_free_every_cell() -> None:
    # The stop string: text the greedy answer to the first question really contains.
    config = EngineConfig(context_length=1024, max_running_requests=1, threads=2)
    async with engine.open_engine(config) as eng:
        async with eng.submit(request(0, stream=False, max_new_tokens=60)) as stream:
            text = "".join([item.text async for item in stream])  # type: ignore[union-attr]
    stop = text[40:46]
    steps, step_reasons, _ = await workload(1, stop)
    runs, run_reasons, run_frames = await workload(64, stop)
    assert run_reasons == step_reasons
    assert step_reasons[4] == "stop" and step_reasons[3] == "abort"
    # The aborted victim (unary: its tokens came a run at a time) kept what was decoded
    # before the abort, which is its own greedy output.
    assert len(runs[3]) >= 10
    assert runs[3] == steps[3][: len(runs[3])] or steps[3] == runs[3][: len(steps[3])]
    # The streamed request got its tokens one by one (its runs woke the loop each decode).
    assert run_frames[1] >= len(runs[1]) - 2
    del runs[3], steps[3]
    assert runs == steps
    assert all(runs)


async def test_closing_the_engine_during_a_run_ends_it_within_a_decode() -> None:
    """The scheduler's cancellation stops the compute thread's run after its decode; the
    request ends with the shutdown's 503 and everything is freed."""
    # Runs of up to 2,000 decodes (some 20 s): only the stop ends this one early.
    config = EngineConfig(
        context_length=4096, max_running_requests=2, threads=2, max_run_decodes=2000
    )
    got: list[engine.Output] = []
    async with engine.open_engine(config) as eng:
        stream = eng.submit(request(0, stream=False, max_new_tokens=3000))
        stream.redirect(got.append)
        await trio.sleep(1.0)  # well into the first run
        assert [item.completion_tokens for item in got] == [1]  # the prefill's token only
        closing = trio.current_time()
    assert trio.current_time() - closing < 0.5  # a decode takes about 10 ms
    done = got[-1]
    assert isinstance(done, Done)
    assert done.finish_reason["status_code"] == 503
    assert done.completion_tokens < 3000


async def test_a_lone_unary_request_wakes_the_loop_once_a_run() -> None:
    config = EngineConfig(context_length=1024, max_running_requests=2, threads=2)
    frames: dict[bool, list[int]] = {}
    async with engine.open_engine(config) as eng:
        for streamed in (False, True):
            async with eng.submit(request(1, stream=streamed, max_new_tokens=150)) as stream:
                frames[streamed] = [len(item.output_ids) async for item in stream]  # type: ignore[union-attr]
    assert sum(frames[False]) == sum(frames[True]) == 150
    assert len(frames[False]) <= 2 + 150 // 64  # the prefill's token, then a frame a run
    assert len(frames[True]) >= 148


async def test_an_abort_mid_run_keeps_the_tokens_decoded_before_it() -> None:
    """A lone unary request delivers nothing until its run ends: aborted mid-run, it still
    gets the tokens decoded before the abort (its own greedy output), as steps would have
    committed them."""
    config = EngineConfig(
        context_length=4096, max_running_requests=2, threads=2, max_run_decodes=2000
    )
    got: list[engine.Output] = []
    async with engine.open_engine(config) as eng:
        stream = eng.submit(request(0, stream=False, rid="victim", max_new_tokens=3000))
        stream.redirect(got.append)
        with trio.fail_after(10):
            while not got:  # the prefill's token
                await trio.sleep(0.01)
        await trio.sleep(0.5)  # some 40 decodes into a run of 2,000
        assert [item.completion_tokens for item in got] == [1]  # nothing of the run yet
        assert eng.abort("victim") == 1
        with trio.fail_after(5):  # the abort takes effect at the run's next decode
            while not isinstance(got[-1], Done):
                await trio.sleep(0.01)
        done = got[-1]
        assert isinstance(done, Done) and done.finish_reason["type"] == "abort"
        kept = [t for item in got for t in item.output_ids]
        assert len(kept) == done.completion_tokens >= 10
        async with eng.submit(request(0, stream=False, max_new_tokens=len(kept))) as again:
            assert [t async for item in again for t in item.output_ids] == kept  # type: ignore[union-attr]
        with trio.fail_after(10):
            while eng.stats().running or eng.stats().kv_used_cells:
                await trio.sleep(0.01)


async def test_a_streamed_run_does_not_run_ahead_of_a_lagging_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reader that blocks the event loop (100 ms a frame, several decodes) gets frames of a
    few tokens, not all the tokens a run would have decoded meanwhile: the run hands back to
    single steps once two decodes wait to be taken. The tokens are those of steps."""
    from tributary.engine import compute_thread as compute
    from tributary.engine.runners.llama import decode_run

    waiting: list[int] = []  # at each decode a waking run published, how many waited
    publish = compute._Handoff.publish

    def counted(self: compute._Handoff[object], item: object, wake: bool) -> int:
        n = publish(self, item, wake)
        if wake:
            waiting.append(n)
        return n

    monkeypatch.setattr(compute._Handoff, "publish", counted)
    got: dict[int, list[list[int]]] = {}
    for max_run in (1, 64):
        config = EngineConfig(
            context_length=1024, max_running_requests=2, threads=2, max_run_decodes=max_run
        )
        async with engine.open_engine(config) as eng:
            async with eng.submit(request(1, stream=True, max_new_tokens=30)) as stream:
                frames = []
                async for item in stream:
                    frames.append(item.output_ids)  # type: ignore[union-attr]
                    time.sleep(0.1)  # the event loop busy elsewhere
            got[max_run] = frames
    ran = got[64]
    assert [t for f in ran for t in f] == [t for f in got[1] for t in f]
    assert waiting and max(waiting) <= 1 + decode_run.MAX_UNTAKEN, waiting
    assert max(len(f) for f in ran) <= 3, [len(f) for f in ran]


async def test_a_decode_ahead_skips_a_slot_closed_or_reopened_since() -> None:
    """A run's last tokens may end their request before the decode launched after them is
    queued: a decode ahead for a slot closed meanwhile, or given to another sequence, is
    not run and leaves no KV cell behind."""
    from tributary.engine.compute_thread import compute_thread
    from tributary.engine.core import open_runner
    from tributary.engine.runners.base import SeqStep

    runner = await open_runner(EngineConfig(context_length=512, max_running_requests=2))
    try:
        params = SamplingParams.from_dict({"temperature": 0})
        prompt = runner.tokenize(CHAT.format(QUESTIONS[0]), add_special=False)
        for reopen in (False, True):
            runner.open_sequence(0, params)
            (token,) = await runner.step([SeqStep(0, prompt, 0, sample=True)])
            await compute_thread().run(lambda: None)  # the decode launched ahead
            await runner.step([SeqStep(0, [token], len(prompt), sample=True)])
            runner.close_sequence(0)
            if reopen:
                runner.open_sequence(0, params)
            await compute_thread().run(lambda: None)  # the free job and that decode ahead
            stale = [(0, token, len(prompt) + 1)]
            left = runner._ahead  # type: ignore[attr-defined]  # the second step's, unused
            await compute_thread().run(runner._decode_ahead, stale)  # type: ignore[attr-defined]
            assert runner._ahead is left  # type: ignore[attr-defined]  # not decoded
            assert runner.kv_used_cells() == 0
            if reopen:
                runner.close_sequence(0)
                await compute_thread().run(lambda: None)
    finally:
        runner.close()


async def test_runs_with_overlap_off_give_the_tokens_steps_give_and_leave_nothing_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With decoding ahead off, a run stopped mid-decode (requests arrive during runs) samples
    that decode itself: no step ever finds a decode left ahead."""
    from tributary.engine.runners.llama import LlamaRunner

    found_ahead: list[bool] = []
    step_sync = LlamaRunner._step_sync

    def watched(self: LlamaRunner, *args: object, **kwargs: object) -> list[int]:
        found_ahead.append(self._ahead is not None)
        return step_sync(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(LlamaRunner, "_step_sync", watched)
    steps, step_reasons, _ = await workload(1, None, overlap=False)
    runs, run_reasons, _ = await workload(64, None, overlap=False)
    assert found_ahead and not any(found_ahead)
    assert run_reasons == step_reasons
    victim_runs, victim_steps = runs.pop(3), steps.pop(3)
    assert len(victim_runs) >= 10
    assert victim_steps[: len(victim_runs)] == victim_runs[: len(victim_steps)]
    assert runs == steps
