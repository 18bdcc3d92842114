"""Decode runs on the real model: the llama runner decodes a run's tokens back to back on its
compute thread, and they are the tokens single steps give, through requests that arrive,
end (a stop string found after the decode that made it, a length), are aborted mid-run and
sample at a temperature; every KV cell comes back and the engine serves on."""

from __future__ import annotations

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


async def workload(max_run: int, stop: str | None) -> tuple[list[list[int]], list[str], list[int]]:
    """A unary and a streamed request from the start, a seeded one with penalties joining
    mid-run, a victim aborted after its tenth token, and a unary one with a stop string."""
    config = EngineConfig(
        context_length=1024, max_running_requests=4, threads=2, max_run_decodes=max_run
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
