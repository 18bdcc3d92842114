"""N-gram speculative decoding on the sim runner, under Trio's autojump clock: drafts, their
verification, multi-token commits through the stop checks, aborts and counts.

The sim's greedy output is a function of every token fed so far, so a draft it rejects must
leave no trace (its KV is dropped) for the output to match plain decoding. A positive
`logit_bias` forces one token, so a repetitive prompt then has every draft accepted.
"""

from __future__ import annotations

import dataclasses

import pytest
import trio

from tributary import engine, testing
from tributary.engine import Done, Frame, GenerateRequest, SamplingParams, SimLatency
from tributary.engine.speculative import NgramDrafter, SeqSpeculation

LAT = SimLatency(step_base=0.010, decode_per_seq=0.002, prefill_per_token=0.001)
SPEC = {"sim_latency": LAT, "speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4}
A = ord("a") + 3  # the sim's token for "a"

pytestmark = pytest.mark.tributary_config(**SPEC)


def request(text: str, **sampling: object) -> GenerateRequest:
    params = {"temperature": 0, "max_new_tokens": 20, **sampling}
    return GenerateRequest(text=text, sampling=SamplingParams.from_dict(params))


async def run(eng: engine.Engine, req: GenerateRequest) -> tuple[list[Frame], Done]:
    frames: list[Frame] = []
    async with eng.submit(req) as stream:
        async for item in stream:
            if isinstance(item, Frame):
                frames.append(item)
            else:
                assert isinstance(item, Done)
                return frames, item
    raise AssertionError("no Done")


def ids(frames: list[Frame], done: Done) -> list[int]:
    return [t for f in frames for t in f.output_ids] + done.output_ids


async def test_accepted_drafts_commit_several_tokens_a_step(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    frames, done = await run(eng, request("aaaa", logit_bias={str(A): 100}))
    # Step 1 prefills and samples one token; each later step verifies 4 drafts and keeps
    # them plus the token after them (5 tokens), until max_new_tokens leaves room for 3.
    assert ids(frames, done) == [A] * 20
    assert done.finish_reason == {"type": "length", "length": 20}
    assert [len(f.output_ids) for f in frames] == [1, 5, 5, 5]
    assert len(done.output_ids) == 4  # 3 drafts and the sampled token: exactly 20
    assert eng.stats().steps == 5
    assert done.speculative == engine.SpecCounts(4, 15, 15)
    stats = eng.stats()
    assert (stats.spec_verifies, stats.spec_draft_tokens, stats.spec_accepted_tokens) == (4, 15, 15)


async def test_stop_string_inside_the_accepted_drafts_ends_there(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    _, done = await run(tributary_engine, request("aaaa", logit_bias={str(A): 100}, stop="aaa"))
    # The second step keeps 5 tokens, but the stop string ends the request at its third.
    assert done.completion_tokens == 3
    assert done.finish_reason == {"type": "stop", "matched": "aaa"}
    assert done.speculative == engine.SpecCounts(1, 4, 4)


async def test_stop_token_inside_the_accepted_drafts_ends_there(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    frames, done = await run(
        tributary_engine, request("aaaa", logit_bias={str(A): 100}, stop_token_ids=[A])
    )
    # min_new_tokens is 0: the first "a" is a stop token and ends it before any draft.
    assert ids(frames, done) == [A] and done.speculative == engine.SpecCounts(0, 0, 0)


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 1.0, "sampling_seed": 7}],
    ids=["greedy", "seeded"],
)
async def test_output_is_what_plain_decoding_gives(
    autojump_clock: trio.abc.Clock, sampling: dict[str, object]
) -> None:
    """Rejected drafts leave no trace: the sim's next token depends on every token fed."""
    text = "the cat sat on the mat. the cat sat on the mat. the cat"
    outputs = []
    for spec in (False, True):
        config = testing.sim_config(**(SPEC if spec else {"sim_latency": LAT}))
        async with engine.open_engine(config) as eng:
            frames, done = await run(eng, request(text, max_new_tokens=60, **sampling))
            outputs.append(ids(frames, done))
            if spec:
                assert done.speculative is not None and done.speculative.draft_tokens > 0
                assert done.speculative.accepted_tokens < done.speculative.draft_tokens
    assert outputs[0] == outputs[1]
    assert len(outputs[0]) == 60


async def test_a_request_can_turn_speculation_off(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    frames, done = await run(
        tributary_engine,
        request("aaaa", logit_bias={str(A): 100}, speculative_num_draft_tokens=0),
    )
    assert ids(frames, done) == [A] * 20
    assert done.speculative is None
    assert tributary_engine.stats().spec_draft_tokens == 0
    # A lower bound than the server's: at most 2 drafts a step.
    _, done = await run(
        tributary_engine,
        request("aaaa", logit_bias={str(A): 100}, speculative_num_draft_tokens=2),
    )
    assert done.completion_tokens == 20
    # 1 + 6 * 3 tokens, then no room for a draft before the 20th.
    assert done.speculative == engine.SpecCounts(6, 12, 12)


async def test_min_new_tokens_holds_drafts_back_until_reached(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    _, done = await run(
        tributary_engine, request("aaaa", logit_bias={str(A): 100}, min_new_tokens=10)
    )
    assert done.completion_tokens == 20
    # 10 single steps while EOS is masked, then 4 + 1 tokens a step: 15, 20.
    assert done.speculative == engine.SpecCounts(2, 8, 8)


async def test_abort_during_speculation_keeps_what_was_sent(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    plain = eng.submit(request("hello world", max_new_tokens=30, speculative_num_draft_tokens=0))
    received: list[int] = []
    spec = request("aaaa", logit_bias={str(A): 100}, max_new_tokens=1000)
    async with eng.submit(dataclasses.replace(spec, rid="spec")) as stream:
        async for item in stream:
            if isinstance(item, Frame):
                received += item.output_ids
                if len(received) > 5:
                    assert eng.abort("spec") == 1
            else:
                assert isinstance(item, Done)
                received += item.output_ids
                assert item.finish_reason["type"] == "abort"
                # The step running as it was aborted commits nothing for it.
                assert item.completion_tokens == len(received) == 6
    async with plain:
        items = [item async for item in plain]
    done = items[-1]
    assert isinstance(done, Done) and done.completion_tokens == 30


def test_drafter_proposes_what_followed_the_longest_match() -> None:
    # "1 2 3 9 | 1 2 3 4 5 | ... 1 2 3": the longest match of the suffix is the second one.
    drafter = NgramDrafter([1, 2, 3, 9, 7, 1, 2, 3, 4, 5, 6, 0, 2, 3], min_n=1, max_n=4)
    assert drafter.draft(3) == [4, 5, 6]
    # Repetition runs past the end: the period repeats.
    assert NgramDrafter([8, 1, 2, 1, 2], min_n=1, max_n=4).draft(5) == [1, 2, 1, 2, 1]
    # A suffix shorter than min_n matches nothing; no earlier occurrence: no draft.
    assert NgramDrafter([5, 1, 6, 1], min_n=2, max_n=4).draft(3) == []
    assert NgramDrafter([1, 2, 3], min_n=1, max_n=4).draft(3) == []


def test_draft_length_follows_what_was_kept() -> None:
    spec = SeqSpeculation(NgramDrafter([7, 7, 7], min_n=1, max_n=4), 8, 3)
    assert len(spec.draft(3, [7], room=100)) == 8  # starts at the most
    spec.verified(8, 2)  # two kept: the next draft is three long
    assert len(spec.draft(3, [7], room=100)) == 3
    spec.verified(3, 3)  # all kept: doubles, up to the most
    assert len(spec.draft(3, [7], room=100)) == 6
    spec.verified(6, 6)
    assert len(spec.draft(3, [7], room=5)) == 5  # never past the room left
    assert spec.counts() == engine.SpecCounts(3, 17, 11)


def test_a_draft_that_cannot_fit_one_batch_is_refused_at_start_up() -> None:
    # The llama runner verifies [last, d1 .. dk] in one batch of at least prefill_chunk_tokens.
    with pytest.raises(ValueError, match=r"\(16\) must be below prefill_chunk_tokens \(16\)"):
        engine.EngineConfig(
            speculative_algorithm="NGRAM", speculative_num_draft_tokens=16, prefill_chunk_tokens=16
        )
    engine.EngineConfig(speculative_num_draft_tokens=16, prefill_chunk_tokens=16)  # off: fine


async def test_a_request_that_finds_no_draft_decodes_in_short_runs(
    autojump_clock: trio.abc.Clock,
) -> None:
    # A match of 12 tokens is never found in this prompt: the request drafts nothing, so its
    # decodes go in runs of SPEC_RUN_DECODES (looking for a draft between them), not one
    # step per token, and its tokens are those of a server that does not speculate. A unary
    # request gets a frame per step, or one per run (its tokens are handed over at the end).
    async def generate(**config: object) -> tuple[list[int], int]:
        cfg = engine.EngineConfig(runner="sim", sim_latency=LAT, **config)  # type: ignore[arg-type]
        req = dataclasses.replace(request("the quick brown fox", max_new_tokens=24), stream=False)
        async with engine.open_engine(cfg) as eng:
            frames, done = await run(eng, req)
            return ids(frames, done), len(frames)

    plain, plain_frames = await generate()
    spec_ids, spec_frames = await generate(
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=4,
        speculative_ngram_min_match_window_size=12,
    )
    assert spec_ids == plain
    assert plain_frames <= 2  # the first token's step, then one run
    # The first token's step, then runs of at most 4 decodes: 23 tokens in at least 6.
    assert 6 <= spec_frames <= 8


@pytest.mark.parametrize("limit, drafted", [(4, False), (0, True)])
async def test_no_drafts_while_more_requests_than_the_batch_limit_run(
    autojump_clock: trio.abc.Clock, limit: int, drafted: bool
) -> None:
    # Five repetitive requests at once: over a limit of 4 none of them drafts (their tokens
    # are those of plain decoding); with no limit each of them does.
    cfg = engine.EngineConfig(
        runner="sim",
        **SPEC,
        speculative_disable_by_batch_size=limit,  # type: ignore[arg-type]
    )
    async with engine.open_engine(cfg) as eng:
        done: list[Done] = []

        async def one() -> None:
            done.append((await run(eng, request("aaaa", logit_bias={str(A): 100})))[1])

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(one)
    assert len(done) == 5
    assert all(d.completion_tokens == 20 for d in done)
    counts = [d.speculative for d in done]
    if drafted:
        assert all(c is not None and c.accepted_tokens > 0 for c in counts)
    else:
        assert all(c is not None and c.draft_tokens == 0 for c in counts)


def test_the_batch_limit_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size must be at least 0"):
        engine.EngineConfig(speculative_disable_by_batch_size=-1)
