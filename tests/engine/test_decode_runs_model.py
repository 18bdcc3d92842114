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


async def workload(max_run: int, stop: str | None) -> tuple[list[list[int]], list[str]]:
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
    async with engine.open_engine(config) as eng:

        async def client(i: int, at: float, req: GenerateRequest) -> None:
            await trio.sleep(at)
            async with eng.submit(req) as stream:
                async for item in stream:
                    assert not isinstance(item, engine.Error), item.error
                    ids[i] += item.output_ids
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
    return ids, reasons


async def test_runs_give_the_tokens_steps_give_and_free_every_cell() -> None:
    # The stop string: text the greedy answer to the first question really contains.
    config = EngineConfig(context_length=1024, max_running_requests=1, threads=2)
    async with engine.open_engine(config) as eng:
        async with eng.submit(request(0, stream=False, max_new_tokens=60)) as stream:
            text = "".join([item.text async for item in stream])  # type: ignore[union-attr]
    stop = text[40:46]
    steps, step_reasons = await workload(1, stop)
    runs, run_reasons = await workload(64, stop)
    assert run_reasons == step_reasons
    assert step_reasons[4] == "stop" and step_reasons[3] == "abort"
    # The aborted victim: whatever it got before the abort is its own greedy output.
    assert runs[3] == steps[3][: len(runs[3])] or steps[3] == runs[3][: len(steps[3])]
    del runs[3], steps[3]
    assert runs == steps
    assert all(runs)
