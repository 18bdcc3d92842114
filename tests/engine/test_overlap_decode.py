"""Decoding ahead (`overlap_decode`) changes when decodes run, never what they compute: the
same tokens as stepping one plan at a time, through finishes, admissions, aborts and seeded
sampling, and every KV cell comes back."""

from __future__ import annotations

import pytest
import trio

from tributary import engine
from tributary.engine import Done, EngineConfig, Frame, GenerateRequest, SamplingParams

pytestmark = pytest.mark.model

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "List two planets.",
]


def request(i: int, **sampling: object) -> GenerateRequest:
    # Different lengths, so sequences finish (and free their slots) at different steps.
    params = {"temperature": 0, "max_new_tokens": 6 + 5 * i, **sampling}
    return GenerateRequest(
        text=CHAT.format(QUESTIONS[i % len(QUESTIONS)]), sampling=SamplingParams.from_dict(params)
    )


async def workload(overlap: bool) -> list[list[int]]:
    """Six requests on four slots (so two wait and are admitted mid-flight), one of them
    seeded at temperature 1, and a victim aborted after a few tokens."""
    config = EngineConfig(
        context_length=1024, max_running_requests=4, threads=1, overlap_decode=overlap
    )
    outputs: list[list[int]] = [[] for _ in range(6)]
    async with engine.open_engine(config) as eng:
        reqs = [request(i) for i in range(5)]
        reqs.append(request(5, temperature=1.0, sampling_seed=7))
        streams = [eng.submit(r) for r in reqs]
        victim = eng.submit(request(0, max_new_tokens=200, ignore_eos=True))

        async def drain(i: int) -> None:
            async with streams[i] as stream:
                async for item in stream:
                    assert not isinstance(item, engine.Error), item.error
                    outputs[i] += item.output_ids
            assert isinstance(item, Done)

        async with trio.open_nursery() as nursery:
            for i in range(len(streams)):
                nursery.start_soon(drain, i)
            async with victim:
                async for item in victim:
                    if isinstance(item, Frame) and item.completion_tokens >= 3:
                        break
        with trio.fail_after(10):
            while eng.stats().running:
                await trio.sleep(0.01)
        stats = eng.stats()
        assert stats.running == 0 and stats.waiting == 0 and stats.kv_used_cells == 0
    return outputs


async def test_overlap_gives_the_same_tokens_and_frees_every_cell() -> None:
    ahead = await workload(overlap=True)
    in_step = await workload(overlap=False)
    assert ahead == in_step
    assert all(ahead)


@pytest.mark.parametrize("overlap", [True, False])
async def test_the_kv_count_follows_a_decoding_sequence(overlap: bool) -> None:
    # A lone request: its cells are its prompt and every token fed back so far. Read as
    # each token is delivered (in the scheduler, before it plans the next step), decoding
    # ahead may already have decoded the token just delivered: one cell more. Single steps
    # (a run goes on decoding while its tokens are delivered: tests/engine/test_decode_runs*).
    config = EngineConfig(
        context_length=1024,
        max_running_requests=2,
        threads=1,
        overlap_decode=overlap,
        max_run_decodes=1,
    )
    async with engine.open_engine(config) as eng:
        stream = eng.submit(request(0, max_new_tokens=40, ignore_eos=True))
        seen: list[tuple[int, int]] = []

        def on_item(_index: int, item: engine.Output) -> bool:
            if isinstance(item, Frame):
                fed_back = stream.prompt_tokens + item.completion_tokens - 1
                seen.append((eng.stats().kv_used_cells - fed_back, item.completion_tokens))
            return False

        async with stream:
            await engine.collect_redirected([stream], on_item)
        assert len(seen) > 30
        assert all(extra in ((0, 1) if overlap else (0,)) for extra, _ in seen), seen
        with trio.fail_after(10):
            while eng.stats().kv_used_cells:
                await trio.sleep(0.01)
