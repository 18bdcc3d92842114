"""The prefix cache and forked parallel samples: the cache's own bookkeeping (LRU, bound,
pins, whole prompts and their logits rows, lookups in modes "exact" and "any"), and the
scheduling around it on the sim runner under the autojump clock (what is
reported, what a flush does, what an abort during a restore or a fork frees). Whether a
restored or forked KV gives the same tokens on the real model is tests/engine/test_kv_reuse.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from tributary import engine, testing
from tributary.engine import Done, EngineConfig, GenerateRequest, SamplingParams, SimLatency
from tributary.engine.prefix_cache import PrefixCache
from tributary.engine.request import LogprobRequest
from tributary.engine.runners.sim import SimKVState

LAT = SimLatency(step_base=0.010, decode_per_seq=0.002, prefill_per_token=0.001)
CHUNK = 256
ROW = np.zeros(8, dtype=np.float32)  # a logits row of 32 bytes

pytestmark = pytest.mark.tributary_config(sim_latency=LAT)


def state(n_tokens: int, nbytes: int | None = None) -> SimKVState:
    return SimKVState(tuple(range(n_tokens)), n_tokens if nbytes is None else nbytes)


def prompt(n: int, start: int = 0) -> list[int]:
    """n sim tokens (byte values 3..258), distinct from another prompt with another start."""
    return [3 + (start + i) % 250 for i in range(n)]


def ids_request(ids: list[int], **sampling: object) -> GenerateRequest:
    params = {"temperature": 0, "max_new_tokens": 4, **sampling}
    return GenerateRequest(input_ids=ids, sampling=SamplingParams.from_dict(params))


async def run(eng: engine.Engine, req: GenerateRequest) -> Done:
    items = await testing.collect(eng.submit(req))
    done = items[-1]
    assert isinstance(done, Done), done
    return done


# -- the cache's bookkeeping ----------------------------------------------------------------


def test_lookup_takes_the_longest_chunk_aligned_prefix_and_leaves_a_token() -> None:
    cache = PrefixCache(capacity_bytes=1 << 20, chunk=4)
    tokens = list(range(100, 112))  # 3 chunks
    assert cache.insert(tokens, state(12))
    assert cache.lookup(tokens[:3]) is None  # no whole chunk
    hit = cache.lookup(tokens[:5])
    assert hit is not None and hit.n_tokens == 4
    hit = cache.lookup(tokens)  # all 12 cached, but one must be left to compute
    assert hit is not None and hit.n_tokens == 8
    hit = cache.lookup([*tokens, 7])
    assert hit is not None and hit.n_tokens == 12
    assert cache.lookup([*tokens[:6], 0, 0, 0]) is not None  # shares one chunk
    assert cache.lookup([0, *tokens]) is None  # nothing shared from the start


def test_a_longer_entry_replaces_its_prefixes_and_a_held_one_is_not_stored_twice() -> None:
    cache = PrefixCache(capacity_bytes=1 << 20, chunk=4)
    tokens = list(range(12))
    assert cache.insert(tokens[:4], state(4))
    assert cache.insert(tokens[:8], state(8))
    assert len(cache) == 1 and cache.bytes == 8  # the 4-token entry was redundant
    assert not cache.insert(tokens[:4], state(4))  # held by the 8-token entry
    assert len(cache) == 1 and cache.holds(tokens[:4]) and not cache.holds(tokens)


def test_eviction_is_least_recently_used_and_holds_the_bound() -> None:
    cache = PrefixCache(capacity_bytes=100, chunk=4)
    a, b, c, d = ([k] * 4 for k in range(4))
    for tokens in (a, b, c):
        assert cache.insert(tokens, state(4, nbytes=30))
    assert cache.lookup([*a, 9]) is not None  # a is now the most recently used
    assert cache.insert(d, state(4, nbytes=30))  # evicts b, the least recently used
    assert [e.tokens for e in cache] == [tuple(c), tuple(a), tuple(d)]
    assert cache.bytes == 90 <= cache.capacity_bytes and cache.evictions == 1
    assert not cache.insert([5] * 4, state(4, nbytes=101))  # larger than the whole bound
    assert cache.bytes == 90


def test_a_pinned_entry_is_never_evicted() -> None:
    cache = PrefixCache(capacity_bytes=60, chunk=4)
    a, b = [1] * 4, [2] * 4
    assert cache.insert(a, state(4, nbytes=30)) and cache.insert(b, state(4, nbytes=30))
    hit_a, hit_b = cache.lookup([*a, 0]), cache.lookup([*b, 0])
    assert hit_a is not None and hit_b is not None
    cache.pin(hit_a.entry)
    cache.pin(hit_b.entry)
    assert not cache.insert([3] * 4, state(4, nbytes=30))  # nothing may leave: not stored
    assert cache.clear() == 0 and len(cache) == 2 and cache.pins == 2
    cache.unpin(hit_a.entry)
    assert cache.insert([3] * 4, state(4, nbytes=30))
    assert [e.tokens[0] for e in cache] == [2, 3] and cache.bytes == 60


def test_a_whole_prompt_with_logits_is_found_whole_and_its_prefixes_by_mode() -> None:
    tokens = list(range(100, 110))  # 2.5 chunks of 4
    for mode, prefix in (("exact", 8), ("any", 9)):
        cache = PrefixCache(capacity_bytes=1 << 20, chunk=4, mode=mode)
        assert cache.insert(tokens, state(10), ROW)
        hit = cache.lookup(tokens, whole=True)
        assert hit is not None and hit.whole and hit.n_tokens == 10
        hit = cache.lookup(tokens)  # not whole: one token left to compute
        assert hit is not None and not hit.whole and hit.n_tokens == prefix
        hit = cache.lookup([*tokens[:7], 0, 0], whole=True)  # shares 7
        assert hit is not None and hit.n_tokens == (4 if mode == "exact" else 7)
        hit = cache.lookup(tokens[:3], whole=True)  # a prefix shorter than a chunk
        assert (None if hit is None else hit.n_tokens) == (None if mode == "exact" else 2)
        assert cache.bytes == 10 + ROW.nbytes


def test_any_mode_finds_the_longest_common_prefix_among_many_entries() -> None:
    cache = PrefixCache(capacity_bytes=1 << 30, chunk=256, mode="any")
    base = list(range(1000, 1600))
    for cut in (0, 5, 130, 300):  # entries holding `cut` tokens of base, then others
        assert cache.insert([*base[:cut], 7, cut], state(cut + 2))
        assert cache.insert([7, *base[:cut], 8], state(cut + 2))  # sorted among them
    assert cache.lookup([9, 9]) is None
    for shared, expected in ((4, 4), (131, 131), (250, 250), (450, 300)):
        hit = cache.lookup([*base[:shared], 9, 9])
        assert hit is not None and hit.n_tokens == expected
        assert hit.entry.tokens[:expected] == tuple(base[:expected])


def test_a_prompt_without_logits_serves_no_sampling_whole_hit_and_is_upgraded() -> None:
    cache = PrefixCache(capacity_bytes=1 << 20, chunk=4)
    tokens = list(range(9))
    assert cache.insert(tokens, state(9))  # a prompt that sampled nothing
    hit = cache.lookup(tokens, whole=True)
    assert hit is not None and not hit.whole and hit.n_tokens == 8
    hit = cache.lookup(tokens, whole=True, logits=False)  # max_new_tokens == 0: enough
    assert hit is not None and hit.whole
    assert not cache.holds(tokens, logits=True) and cache.holds(tokens)
    assert cache.insert(tokens, state(9), ROW)  # the same tokens with their row: replaces
    assert len(cache) == 1 and cache.holds(tokens, logits=True)
    assert not cache.insert(tokens, state(9))  # already held, better


def test_a_longer_prompt_replaces_a_prefix_but_not_a_whole_prompt_with_logits() -> None:
    cache = PrefixCache(capacity_bytes=1 << 20, chunk=4)
    tokens = list(range(20))
    assert cache.insert(tokens[:8], state(8))  # a prefix only
    assert cache.insert(tokens[:6], state(6), ROW)  # a whole prompt
    assert cache.insert(tokens, state(20), ROW)
    assert sorted(e.n_tokens for e in cache) == [6, 20]  # the 8 left: the 20 serve it
    hit = cache.lookup(tokens[:6], whole=True)
    assert hit is not None and hit.whole and hit.entry.n_tokens == 6


def test_a_sliding_window_entry_serves_only_its_own_length_in_any_mode() -> None:
    cache = PrefixCache(capacity_bytes=1 << 20, chunk=4, window=6, mode="any")
    tokens = list(range(20))
    assert cache.insert(tokens[:10], state(10), ROW)  # longer than the window
    assert cache.lookup(tokens[:9]) is None  # cutting it would lose part of a window
    hit = cache.lookup(tokens[:12])
    assert hit is not None and hit.n_tokens == 10
    hit = cache.lookup(tokens[:10], whole=True)
    assert hit is not None and hit.whole
    assert cache.insert(tokens[:5], state(5))  # within the window: serves its prefixes
    hit = cache.lookup(tokens[:9])
    assert hit is not None and hit.n_tokens == 5


def test_an_unknown_reuse_mode_is_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="prefix_reuse must be exact or any, got 'all'"):
        EngineConfig(prefix_reuse="all")  # type: ignore[arg-type]


# -- on the engine (sim runner) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("exact", [0, 0, 2000, 768, 1792]), ("any", [0, 100, 2000, 999, 2000])],
)
async def test_cached_tokens_on_repeated_prompts(
    mode: str, expected: list[int], autojump_clock: trio.abc.Clock
) -> None:
    """SGLang's endpoint test (checklist item 11: prompts of 100, 10000, 10000, 1000, 11000
    tokens give 0, 100, 9999, 999, 10000 with its token-granular radix cache), scaled to this
    engine. A prompt seen before is restored whole, with its last logits, so all of it is
    cached (SGLang recomputes the last token). Mode "exact" cuts other prefixes at 256-token
    chunk boundaries (100 is none; 1000 gets 768 of the 2000; 2200 gets 1792); mode "any"
    takes SGLang's token-granular prefixes. Both leave one token to compute."""
    async with testing.open_sim_engine(sim_latency=LAT, prefix_reuse=mode) as eng:
        cached = [
            (await run(eng, ids_request(prompt(n)))).cached_tokens
            for n in (100, 2000, 2000, 1000, 2200)
        ]
        assert cached == expected
        assert (await run(eng, ids_request(prompt(2200)))).cached_tokens == 2200
        assert (await run(eng, ids_request(prompt(2000, start=1)))).cached_tokens == 0


async def test_restored_prefix_only_costs_the_rest(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    ids = prompt(600)
    cold_start = trio.current_time()
    cold = await run(eng, ids_request(ids, max_new_tokens=1))
    cold_time = trio.current_time() - cold_start
    longer_start = trio.current_time()
    longer = await run(eng, ids_request([*ids, 7], max_new_tokens=1))
    longer_time = trio.current_time() - longer_start
    warm_start = trio.current_time()
    warm = await run(eng, ids_request(ids, max_new_tokens=1))
    warm_time = trio.current_time() - warm_start
    assert longer.cached_tokens == 512
    assert warm.output_ids == cold.output_ids and warm.cached_tokens == 600
    # Cold: chunks of 256, 256 and 88 tokens; the longer prompt: its 89 past the chunks;
    # the same prompt again: nothing, its first token comes from the saved logits.
    assert cold_time == pytest.approx(
        testing.step_time(LAT, prefill=256) * 2 + testing.step_time(LAT, prefill=88)
    )
    assert longer_time == pytest.approx(testing.step_time(LAT, prefill=89))
    assert warm_time == pytest.approx(testing.step_time(LAT, prefill=0))


async def test_flush_cache_refuses_while_requests_run_and_empties_otherwise(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    await run(eng, ids_request(prompt(300)))
    assert eng.stats().prefix_cache_entries == 1
    async with eng.submit(ids_request(prompt(10), max_new_tokens=50)) as stream:
        await stream.__anext__()  # its prompt, shorter than a chunk, is saved whole too
        assert not eng.flush_cache()  # running: refused, kept
        assert eng.stats().prefix_cache_entries == 2
    await testing.wait_engine_idle(eng)
    assert eng.flush_cache()
    stats = eng.stats()
    assert stats.prefix_cache_entries == 0 and stats.prefix_cache_bytes == 0
    assert (await run(eng, ids_request(prompt(300)))).cached_tokens == 0


async def test_abort_during_a_restore_frees_slot_kv_and_pin(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    ids = prompt(700)
    await run(eng, ids_request(ids))
    seen_pins: list[int] = []
    with trio.CancelScope() as scope:
        async with eng.submit(ids_request([*ids, 7], max_new_tokens=20)):
            # The admitting step restores 512 tokens and prefills 189: leave in the middle.
            await trio.sleep(testing.step_time(LAT, prefill=189) / 2)
            seen_pins.append(eng.idle_report().cache_pins)
            scope.cancel()
    assert seen_pins == [1]  # the entry was pinned while its restore ran
    await testing.wait_engine_idle(eng, timeout=testing.step_time(LAT, prefill=189))
    # The entry itself stays, beside the aborted prompt's (computed all the same).
    assert eng.stats().prefix_cache_entries == 2 and eng.idle_report().cache_pins == 0


async def test_abort_before_a_restore_is_planned_frees_the_pin(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    ids = prompt(700)
    await run(eng, ids_request(ids))
    # Admitted together: the cold prompt's first chunk takes the step's prefill budget, so
    # the other waits a step with its cache hit pinned; it leaves before being planned.
    cold = eng.submit(ids_request(prompt(600, start=3)))
    hit = eng.submit(ids_request([*ids, 7]))  # 512 restored, 189 to prefill
    await trio.sleep(testing.step_time(LAT, prefill=256) / 2)
    assert eng.idle_report().cache_pins == 1
    hit.close()
    # Just past the step boundary that reaps it (Trio orders tasks waking at one instant
    # at random, so not exactly at it).
    await trio.sleep(testing.step_time(LAT, prefill=256) / 2 + 0.001)
    assert eng.idle_report().cache_pins == 0
    assert isinstance((await testing.collect(cold))[-1], Done)
    await testing.wait_engine_idle(eng)


async def test_forked_samples_match_expanded_ones(autojump_clock: trio.abc.Clock) -> None:
    reqs = [ids_request(prompt(600), temperature=0.8, sampling_seed=11 + i) for i in range(4)]
    outputs = {}
    for fork in (True, False):
        config = testing.sim_config(sim_latency=LAT, fork_parallel_samples=fork)
        async with testing.open_sim_engine(config) as eng:
            start = trio.current_time()
            streams = [eng.submit(r) for r in reqs]
            done = []
            for s in streams:
                items = await testing.collect(s)
                assert isinstance(items[-1], Done)
                done.append(items[-1])
            elapsed = trio.current_time() - start
            outputs[fork] = [d.output_ids for d in done], [d.cached_tokens for d in done], elapsed
            await testing.wait_engine_idle(eng)
    (forked, forked_cached, forked_time), (expanded, expanded_cached, expanded_time) = (
        outputs[True],
        outputs[False],
    )
    assert forked == expanded and len(set(map(tuple, forked))) == 4
    assert forked_cached == [0, 600, 600, 600] and expanded_cached == [0, 0, 0, 0]
    assert forked_time < expanded_time


async def test_leader_abort_before_the_fork_lets_the_others_prefill(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    reqs = [ids_request(prompt(600), temperature=0.8, sampling_seed=5 + i) for i in range(3)]
    expected = [(await run(eng, r)).output_ids for r in reqs]
    assert eng.flush_cache()
    streams = [eng.submit(r) for r in reqs]
    await trio.sleep(testing.step_time(LAT, prefill=256) / 2)  # in the leader's first chunk
    streams[0].close()
    results = [await testing.collect(s) for s in streams[1:]]
    assert [r[-1].output_ids for r in results if isinstance(r[-1], Done)] == expected[1:]
    # The first of the others led the rest (the leader saved nothing: it left mid-prompt).
    assert [r[-1].cached_tokens for r in results if isinstance(r[-1], Done)] == [0, 600]
    await testing.wait_engine_idle(eng)
    assert eng.idle_report().cache_pins == 0


async def test_abort_during_the_fork_step_frees_everything(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    reqs = [ids_request(prompt(300), max_new_tokens=40, sampling_seed=i) for i in range(3)]
    streams = [eng.submit(r) for r in reqs]
    # Step 1: the leader's first chunk (256); step 2: its last 44 tokens, and the forks.
    await trio.sleep(testing.step_time(LAT, prefill=256) + testing.step_time(LAT, prefill=44) / 2)
    assert eng.stats().kv_used_cells == 256  # mid-step 2: the forks hold nothing yet
    streams[1].close()
    streams[2].close()
    leader = await testing.collect(streams[0])
    assert isinstance(leader[-1], Done) and leader[-1].completion_tokens == 40
    await testing.wait_engine_idle(eng)


def test_an_entry_that_cannot_fit_beside_pinned_ones_evicts_nothing() -> None:
    """An insert that fails for want of room must not first drop the
    entries it would have evicted, nor the shorter prefixes it would have replaced."""
    cache = PrefixCache(capacity_bytes=100, chunk=4)
    pinned, other, short = [1] * 4, [2] * 4, [3] * 4
    assert cache.insert(pinned, state(4, nbytes=60))
    assert cache.insert(other, state(4, nbytes=30))
    hit = cache.lookup([*pinned, 0])
    assert hit is not None
    cache.pin(hit.entry)
    assert not cache.insert([4] * 4, state(4, nbytes=50))  # 60 pinned + 50 > 100
    assert [e.tokens[0] for e in cache] == [2, 1] and cache.bytes == 90  # other kept
    cache.clear()
    assert [e.tokens[0] for e in cache] == [1]
    assert cache.insert(short, state(4, nbytes=30))
    assert not cache.insert([*short, 5, 5, 5, 5], state(8, nbytes=50))  # would replace short
    assert cache.holds(short) and cache.bytes == 90  # short kept


async def test_a_whole_prompt_hit_costs_no_prefill_and_samples_the_same(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    for n in (30, 700):  # shorter than a chunk; several chunks
        for sampling in ({}, {"temperature": 0.7, "sampling_seed": 3}):
            ids = prompt(n, start=n)
            assert eng.flush_cache()
            cold = await run(eng, ids_request(ids, max_new_tokens=1, **sampling))
            start = trio.current_time()
            warm = await run(eng, ids_request(ids, max_new_tokens=1, **sampling))
            assert trio.current_time() - start == pytest.approx(testing.step_time(LAT))
            assert warm.cached_tokens == n and warm.output_ids == cold.output_ids
    assert eng.idle_report().cache_pins == 0


@pytest.mark.tributary_config(sim_latency=LAT, sim_fail_at_step=2)
async def test_a_failed_whole_prompt_step_unpins_and_keeps_the_entry(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    ids = prompt(30)
    await run(eng, ids_request(ids, max_new_tokens=1))  # step 1: prefilled and saved
    failed = (await testing.collect(eng.submit(ids_request(ids))))[-1]  # step 2: restores
    assert isinstance(failed, engine.Error)
    assert eng.idle_report().cache_pins == 0 and eng.stats().prefix_cache_entries == 1
    assert (await run(eng, ids_request(ids))).cached_tokens == 30  # still served whole


async def test_prompt_logprobs_neither_hit_whole_nor_save_a_logits_row(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    """Restored positions yield no logits to score, and a row computed beside scored rows
    (another output shape) is not kept: a later plain request restores the chunk only."""
    eng = tributary_engine
    ids = prompt(300)
    scored = GenerateRequest(
        input_ids=ids,
        sampling=SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 2}),
        logprobs=LogprobRequest(start_len=100),
    )
    assert (await run(eng, scored)).cached_tokens == 0
    assert (await run(eng, scored)).cached_tokens == 0  # only a prefix before position 100
    assert (await run(eng, ids_request(ids))).cached_tokens == 256
    assert (await run(eng, ids_request(ids))).cached_tokens == 300  # (now with its row)


async def test_identical_prompts_together_each_restore_the_whole_prompt(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    reqs = [ids_request(prompt(400), temperature=0.8, sampling_seed=i) for i in range(3)]
    expected = [(await run(eng, r)).output_ids for r in reqs]  # the 2nd and 3rd: hits
    streams = [eng.submit(r) for r in reqs]
    done = [(await testing.collect(s))[-1] for s in streams]
    assert [d.output_ids for d in done if isinstance(d, Done)] == expected
    assert [d.cached_tokens for d in done if isinstance(d, Done)] == [400] * 3
    await testing.wait_engine_idle(eng)
    assert eng.idle_report().cache_pins == 0


@pytest.mark.tributary_config(sim_latency=LAT, prefix_reuse="any")
async def test_after_a_mid_chunk_restore_the_rest_goes_to_the_next_boundary_then_by_chunks(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    eng = tributary_engine
    ids = prompt(800)
    await run(eng, ids_request(ids[:300]))
    start = trio.current_time()
    done = await run(eng, ids_request(ids, max_new_tokens=1))
    # 300 restored; then 212 to the boundary at 512, then 256, then the last 32.
    assert done.cached_tokens == 300
    assert trio.current_time() - start == pytest.approx(
        sum(testing.step_time(LAT, prefill=n) for n in (212, 256, 32))
    )
    cache = eng._scheduler.prefix_cache
    assert cache is not None and cache.bytes == sum(e.nbytes for e in cache)
    assert eng.flush_cache() and eng.stats().prefix_cache_entries == 0
    assert (await run(eng, ids_request(ids[:300]))).cached_tokens == 0
