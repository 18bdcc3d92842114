"""KV reuse on the real model: a restored prefix or a forked prompt must give exactly the
tokens that prefilling would have (on SmolLM2, and on Gemma 3 with its sliding window under
`-m second_model`); a prompt seen before is restored whole (its KV and last logits row) with
no prompt token computed and the same tokens and logprobs; mode "any" reuses prefixes at any
token, mode "exact" only at chunk boundaries; and the KV memory a configuration takes is
sized (and refused when it cannot fit)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import trio

from tributary import engine
from tributary.engine import Done, EngineConfig, GenerateRequest, SamplingParams
from tributary.engine.kv_memory import InsufficientMemory
from tributary.engine.request import LogprobRequest
from tributary.engine.runners.base import SeqStep

pytestmark = pytest.mark.model

CHUNK = 256
#: SmolLM2-135M's KV at f16: 30 layers x (K + V) x 3 KV heads x 64 x 2 bytes, a token.
BYTES_PER_TOKEN = 23040

CONFIG = EngineConfig(context_length=2048, max_running_requests=4, prefill_chunk_tokens=CHUNK)

#: Each model's sliding attention window: a cached snapshot longer than it serves only its
#: own length (engine/prefix_cache.py). SmolLM2 attends to every position.
WINDOW = {"smollm2-135m": None, "gemma3-270m": 512}


@pytest.fixture
async def eng(model_choice: str) -> AsyncIterator[engine.Engine]:
    async with engine.open_engine(dataclasses.replace(CONFIG, model_path=model_choice)) as eng:
        yield eng


def document(eng: engine.Engine, n_tokens: int) -> list[int]:
    """n_tokens of varied English (a prompt the model answers sensibly, unlike random ids)."""
    lines = [
        f"Note {i}: the {word} in room {i * 7 % 31} was moved to shelf {i % 5} on day {i}."
        for i, word in enumerate(["book", "lamp", "clock", "vase", "map", "cup"] * 40)
    ]
    ids = eng.tokenize("\n".join(lines))
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


def request(ids: list[int], *, top_n: int = 0, **sampling: object) -> GenerateRequest:
    params = {"temperature": 0, "max_new_tokens": 24, **sampling}
    return GenerateRequest(
        input_ids=ids,
        sampling=SamplingParams.from_dict(params),
        logprobs=LogprobRequest(top_n=top_n) if top_n else None,
    )


@dataclasses.dataclass
class Result:
    output_ids: list[int]
    cached_tokens: int
    #: Each output token's (logprob, id), and its top alternatives (with `top_n`).
    logprobs: tuple[list[Any], list[Any]] = ([], [])
    finish_reason: Any = None


async def drain(stream: engine.RequestStream) -> Result:
    ids: list[int] = []
    tokens: list[Any] = []
    tops: list[Any] = []
    async with stream:
        async for item in stream:
            assert not isinstance(item, engine.Error), item.error
            ids += item.output_ids
            if item.logprobs is not None:
                tokens += item.logprobs.output_token
                tops += item.logprobs.output_top or []
    assert isinstance(item, Done)
    return Result(ids, item.cached_tokens, (tokens, tops), item.finish_reason)


async def run(eng: engine.Engine, req: GenerateRequest) -> Result:
    return await drain(eng.submit(req))


async def run_together(eng: engine.Engine, reqs: list[GenerateRequest]) -> list[Result]:
    streams = [eng.submit(r) for r in reqs]  # submitted first: admitted in the same step
    results: list[Result | None] = [None] * len(reqs)

    async def one(i: int) -> None:
        results[i] = await drain(streams[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(reqs)):
            nursery.start_soon(one, i)
    return [r for r in results if r is not None]


@pytest.mark.parametrize("chunks", [1, 2, 3])
async def test_a_cache_hit_gives_the_tokens_prefilling_gives(
    eng: engine.Engine, chunks: int
) -> None:
    shared = document(eng, chunks * CHUNK)
    other = eng.tokenize("\nQuestion: which shelf holds the lamp? Answer:", add_special=False)
    mine = eng.tokenize("\nQuestion: what was moved on day 3? Answer:", add_special=False)
    assert eng.flush_cache()
    await run(eng, request(shared + other))  # caches the shared chunks
    warm = await run(eng, request(shared + mine))
    assert warm.cached_tokens == chunks * CHUNK
    assert eng.flush_cache()
    cold = await run(eng, request(shared + mine))
    assert cold.cached_tokens == 0
    assert warm.output_ids == cold.output_ids


async def test_forked_samples_match_expanded_ones(model_choice: str) -> None:
    """n = 4 samples of one prompt: forked from one prefill, or each prefilled (the four fit
    one step's prefill budget, so both ways decode in the same batches). Seeded samples are
    the same tokens; so are greedy ones after a multi-chunk prompt (each fork's KV copy is
    used for 24 tokens)."""
    short_outputs, long_outputs = [], []
    for fork in (True, False):
        config = EngineConfig(
            model_path=model_choice,
            context_length=2048,
            max_running_requests=4,
            prefix_cache_mb=0,
            fork_parallel_samples=fork,
        )
        async with engine.open_engine(config) as eng:
            short = document(eng, 60)
            seeded = [request(short, temperature=0.8, sampling_seed=40 + i) for i in range(4)]
            done = await run_together(eng, seeded)
            short_outputs.append([d.output_ids for d in done])
            assert [d.cached_tokens for d in done] == ([0, 60, 60, 60] if fork else [0] * 4)
            done = await run_together(eng, [request(document(eng, 600))] * 4)
            long_outputs.append([d.output_ids for d in done])
            assert [d.cached_tokens for d in done] == ([0, 600, 600, 600] if fork else [0] * 4)
            assert eng.idle_report().idle
    assert short_outputs[0] == short_outputs[1]
    assert len({tuple(o) for o in short_outputs[0]}) == 4  # four different draws
    assert long_outputs[0] == long_outputs[1]


async def test_eviction_is_lru_within_the_bound_and_outputs_stay_the_same() -> None:
    # Room for two 300-token prompts (6.8 MiB each: the KV of every position and the last
    # logits row, 192 KiB), not three.
    config = EngineConfig(context_length=1024, max_running_requests=2, prefix_cache_mb=15)
    async with engine.open_engine(config) as eng:
        text = document(eng, 3 * 300)
        a, b, c = (text[i * 300 : (i + 1) * 300] for i in range(3))
        cold = {name: await run(eng, request(p)) for name, p in (("a", a), ("b", b))}
        assert eng.stats().prefix_cache_entries == 2
        assert (await run(eng, request(a))).cached_tokens == 300  # a is now recently used
        cold["c"] = await run(eng, request(c))  # evicts b, the least recently used
        stats = eng.stats()
        assert stats.prefix_cache_entries == 2
        assert 2 * 300 * BYTES_PER_TOKEN <= stats.prefix_cache_bytes <= 15 << 20
        # (A miss stores its prompt and evicts in turn: the hits go first.)
        again = {name: await run(eng, request(p)) for name, p in (("a", a), ("c", c), ("b", b))}
        assert [again[n].cached_tokens for n in "acb"] == [300, 300, 0]
        assert all(again[n].output_ids == cold[n].output_ids for n in "abc")
        assert eng.stats().prefix_cache_bytes <= 15 << 20


async def test_q8_0_kv_cache_takes_about_half_the_memory_and_still_answers() -> None:
    sizes = {}
    for dtype in ("f16", "q8_0"):
        config = EngineConfig(context_length=1024, max_running_requests=2, kv_cache_dtype=dtype)
        async with engine.open_engine(config) as eng:
            sizes[dtype] = eng.stats().kv_cache_bytes
            prompt = eng.tokenize("The capital of France is")
            done = await run(eng, request(prompt, max_new_tokens=8))
            assert "Paris" in eng.detokenize(done.output_ids)
    assert sizes["f16"] == 2 * 1024 * BYTES_PER_TOKEN
    assert sizes["q8_0"] == pytest.approx(sizes["f16"] * 34 / 64, rel=0.01)


async def test_a_kv_cache_larger_than_memory_is_refused_naming_the_flags() -> None:
    config = EngineConfig(context_length=8192, max_running_requests=4096)  # ~770 GB of KV
    with pytest.raises(InsufficientMemory) as caught:
        async with engine.open_engine(config):
            pass
    message = str(caught.value)
    for flag in ("--context-length", "--max-running-requests", "--kv-cache-dtype"):
        assert flag in message


async def test_a_hit_on_part_of_a_longer_entry_beside_a_decode_gives_the_same_tokens(
    eng: engine.Engine, model_choice: str
) -> None:
    """The restore that drops an entry's positions past the match
    (`llama_memory_seq_rm`), run while another sequence decodes (its decode launched ahead
    is in flight when the restore is planned), and forks taken beside it too. (An entry of 3
    chunks; of 2 for Gemma 3, whose window of 512 positions is all that may be cut.)"""
    window = WINDOW[model_choice]
    shared = document(eng, (3 if window is None else window // CHUNK) * CHUNK)
    mine = eng.tokenize("\nQuestion: what was moved on day 3? Answer:", add_special=False)
    other = eng.tokenize("Once upon a time, in a land far away,")
    assert eng.flush_cache()
    cold = await run(eng, request(shared[:CHUNK] + mine))
    # Greedy: a seeded draw at temperature 0.8 can change with the decode batch's size (the
    # logits are not bitwise batch-invariant), which is no concern of KV reuse.
    forked = [request(shared[: CHUNK + 40])] * 3
    expected = (await run(eng, forked[0])).output_ids
    assert eng.flush_cache()
    await run(eng, request(shared + mine))  # an entry of 3 chunks
    results: dict[str, object] = {}

    async def decoding() -> None:
        results["other"] = await run(eng, request(other, max_new_tokens=80))

    async def warm() -> None:
        await trio.sleep(0.2)
        results["warm"] = await run(eng, request(shared[:CHUNK] + mine))
        results["forks"] = await run_together(eng, forked)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(decoding)
        nursery.start_soon(warm)
    warm_result = results["warm"]
    assert isinstance(warm_result, Result) and warm_result.cached_tokens == CHUNK
    assert warm_result.output_ids == cold.output_ids
    forks = results["forks"]
    assert isinstance(forks, list)
    assert [f.cached_tokens for f in forks] == [CHUNK, CHUNK + 40, CHUNK + 40]
    assert [f.output_ids for f in forks] == [expected] * 3
    assert eng.idle_report().idle


async def test_an_entry_longer_than_the_window_is_not_cut(
    eng: engine.Engine, model_choice: str
) -> None:
    """A sliding-window model's snapshot keeps only the window's last positions of its
    sliding layers, so a 3-chunk entry cut to 1 chunk would leave the next token without part
    of its window: Gemma 3 prefills instead (SmolLM2 restores the chunk). Either way the
    tokens are those of a cold prefill."""
    shared = document(eng, 3 * CHUNK)
    mine = eng.tokenize("\nQuestion: what was moved on day 3? Answer:", add_special=False)
    assert eng.flush_cache()
    cold = await run(eng, request(shared[:CHUNK] + mine))
    assert eng.flush_cache()
    await run(eng, request(shared + mine))  # an entry of 3 chunks
    warm = await run(eng, request(shared[:CHUNK] + mine))
    assert warm.cached_tokens == (CHUNK if WINDOW[model_choice] is None else 0)
    assert warm.output_ids == cold.output_ids


def record_plans(eng: engine.Engine) -> list[SeqStep]:
    """Every plan entry the runner is given from now on (steps and runs)."""
    runner: Any = eng._runner
    entries: list[SeqStep] = []
    step, decode_run = runner.step, runner.decode_run

    async def recording_step(plan: Sequence[SeqStep]) -> list[int]:
        entries.extend(plan)
        return await step(plan)  # type: ignore[no-any-return]

    async def recording_run(plan: Sequence[SeqStep], *args: Any) -> None:
        entries.extend(plan)
        await decode_run(plan, *args)

    runner.step, runner.decode_run = recording_step, recording_run
    return entries


@pytest.mark.parametrize("n_tokens", [40, 300, 512])  # under a chunk, mid-chunk, 2 chunks
@pytest.mark.parametrize(
    ("sampling", "top_n"),
    [
        ({}, 3),
        ({"temperature": 0.8, "top_p": 0.9, "sampling_seed": 7}, 3),
        # No logprobs, so no hooks: the slot's sampler chain alone (seed, top-k, penalties).
        ({"temperature": 0.8, "top_k": 40, "repetition_penalty": 1.3, "sampling_seed": 7}, 0),
    ],
    ids=["greedy", "seeded", "chain-only"],
)
async def test_a_prompt_seen_before_is_restored_whole_and_answers_as_cold(
    eng: engine.Engine, n_tokens: int, sampling: dict[str, Any], top_n: int
) -> None:
    ids = document(eng, n_tokens)
    assert eng.flush_cache()
    cold = await run(eng, request(ids, top_n=top_n, **sampling))
    assert cold.cached_tokens == 0
    entries = record_plans(eng)
    warm = await run(eng, request(ids, top_n=top_n, **sampling))
    assert warm.cached_tokens == n_tokens
    # No prompt token computed: the first entry restores and feeds nothing.
    assert entries[0].tokens == [] and entries[0].restore is not None
    assert all(e.start_pos >= n_tokens for e in entries)
    assert warm.output_ids == cold.output_ids
    assert warm.logprobs == cold.logprobs  # the same floats: the same logits row
    assert eng.idle_report().cache_pins == 0


async def test_a_whole_prompt_hit_with_suppression_leaves_the_saved_row_intact(
    eng: engine.Engine,
) -> None:
    """min_new_tokens writes -inf into the row at EOS before sampling; a hit samples from a
    copy, so a later hit that forces EOS (logit_bias +100) still gets it."""
    ids = document(eng, 50)
    eos = eng.model_info.eos_token_id
    assert eos is not None
    forced = {"logit_bias": {str(eos): 100.0}, "max_new_tokens": 4}
    assert eng.flush_cache()
    cold = await run(eng, request(ids, min_new_tokens=2, **forced))
    warm = await run(eng, request(ids, min_new_tokens=2, **forced))
    assert warm.cached_tokens == 50 and warm.output_ids == cold.output_ids
    assert eos not in cold.output_ids[:2]
    ends = await run(eng, request(ids, **forced))
    assert ends.cached_tokens == 50 and ends.finish_reason["type"] == "stop"
    assert ends.output_ids == [eos]  # EOS first (its text is never rendered)


async def test_a_whole_prompt_hit_under_a_grammar_answers_as_cold(eng: engine.Engine) -> None:
    ids = document(eng, 60)
    grammar = {"regex": "(yes|no), shelf [0-9]", "max_new_tokens": 12}
    assert eng.flush_cache()
    cold = await run(eng, request(ids, **grammar))
    warm = await run(eng, request(ids, **grammar))
    assert warm.cached_tokens == 60 and warm.output_ids == cold.output_ids
    assert eng.detokenize(warm.output_ids).startswith(("yes, shelf", "no, shelf"))


async def test_exact_mode_reuses_only_chunk_boundaries(eng: engine.Engine) -> None:
    shared = document(eng, 300)
    question = eng.tokenize("\nQuestion: which shelf holds the lamp? Answer:", add_special=False)
    assert eng.flush_cache()
    await run(eng, request(shared[:40]))
    assert (await run(eng, request(shared[:40] + question))).cached_tokens == 0
    await run(eng, request(shared))
    assert (await run(eng, request(shared + question))).cached_tokens == CHUNK


async def test_any_mode_reuses_a_prefix_at_any_token(model_choice: str) -> None:
    config = dataclasses.replace(CONFIG, model_path=model_choice, prefix_reuse="any")
    async with engine.open_engine(config) as eng:
        shared = document(eng, 300)
        question = eng.tokenize(
            "\nQuestion: which shelf holds the lamp? Answer:", add_special=False
        )
        await run(eng, request(shared[:40]))
        short = await run(eng, request(shared[:40] + question, ignore_eos=True))
        assert short.cached_tokens == 40
        await run(eng, request(shared[:290]))
        mid = await run(eng, request(shared + question, ignore_eos=True))  # shares 290
        assert mid.cached_tokens == 290
        assert len(short.output_ids) == len(mid.output_ids) == 24
        again = await run(eng, request(shared + question, ignore_eos=True))
        assert again.cached_tokens == len(shared + question)
        assert again.output_ids == mid.output_ids  # a whole-prompt hit repeats the answer
        assert eng.idle_report().cache_pins == 0
