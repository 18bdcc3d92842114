"""The engine on the real model: SmolLM2-135M-Instruct through llama.cpp. The tests on the
`model_eng` fixture run on Gemma 3 270M too (`-m second_model`)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tributary import engine
from tributary.engine import Done, EngineConfig, Frame, GenerateRequest, SamplingParams
from tributary.engine.runners.hugepages import collapse_available

pytestmark = pytest.mark.model

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite animal is the",
    "In 1969, the first man on the moon was",
    "The quick brown fox",
]


#: A chat turn in each model's own format (Gemma 3 270M is a base model: it continues it
#: but rarely ends the turn).
CHATS = {
    "smollm2-135m": CHAT,
    "gemma3-270m": "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n",
}

#: A prompt and a stop string its greedy continuation holds, per model.
STOPS = {
    "smollm2-135m": (CHAT.format("What is the capital of France?"), "Paris"),
    "gemma3-270m": ("The capital of France is", "country"),  # " the capital of the country"
}

CONFIG = EngineConfig(context_length=2048, max_running_requests=8, prefill_chunk_tokens=256)


@pytest.fixture
async def eng() -> AsyncIterator[engine.Engine]:
    async with engine.open_engine(CONFIG) as eng:
        yield eng


@pytest.fixture
async def model_eng(model_choice: str) -> AsyncIterator[engine.Engine]:
    """The engine on each model in turn (tests of behaviour that must hold for any model)."""
    async with engine.open_engine(dataclasses.replace(CONFIG, model_path=model_choice)) as eng:
        yield eng


def chat(eng: engine.Engine, question: str) -> str:
    return CHATS[eng.config.model_path or "smollm2-135m"].format(question)


def request(prompt: str, **sampling: object) -> GenerateRequest:
    params = {"temperature": 0, "max_new_tokens": 16, **sampling}
    return GenerateRequest(text=prompt, sampling=SamplingParams.from_dict(params))


def ids_request(prompt_ids: list[int], max_new_tokens: int) -> GenerateRequest:
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": max_new_tokens})
    return GenerateRequest(input_ids=prompt_ids, sampling=params)


async def record_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the size of every `llama_decode` call, in order (once the compute thread
    has finished what it was given before, such as a decode launched ahead)."""
    import llama_cpp

    from tributary.engine.compute_thread import compute_thread

    await compute_thread().run(lambda: None)
    sizes: list[int] = []
    decode = llama_cpp.llama_decode

    def counted(ctx: object, batch: llama_cpp.llama_batch) -> int:
        sizes.append(batch.n_tokens)
        return decode(ctx, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(llama_cpp, "llama_decode", counted)
    return sizes


async def run(eng: engine.Engine, req: GenerateRequest) -> tuple[str, list[int], Done]:
    text, ids = "", []
    async with eng.submit(req) as stream:
        async for item in stream:
            assert not isinstance(item, engine.Error), item.error
            text += item.text
            ids += item.output_ids
    assert isinstance(item, Done)
    return text, ids, item


async def run_all(
    eng: engine.Engine, reqs: list[GenerateRequest]
) -> list[tuple[str, list[int], Done]]:
    results: list[tuple[str, list[int], Done] | None] = [None] * len(reqs)
    streams = [eng.submit(r) for r in reqs]  # submit first, so they are batched together

    async def drain(i: int) -> None:
        text, ids = "", []
        async with streams[i] as stream:
            async for item in stream:
                text += item.text
                ids += item.output_ids
        assert isinstance(item, Done)
        results[i] = (text, ids, item)

    async with trio.open_nursery() as nursery:
        for i in range(len(reqs)):
            nursery.start_soon(drain, i)
    return [r for r in results if r is not None]


async def test_model_info_describes_smollm2(eng: engine.Engine) -> None:
    info = eng.model_info
    assert info.name == "SmolLM2-135M-Instruct.Q4_1"
    assert info.vocab_size == 49152
    assert info.context_length == 2048 and info.train_context_length == 8192
    assert 2 in info.eos_token_ids  # <|im_end|>
    assert info.chat_template is not None and "<|im_start|>" in info.chat_template
    assert eng.detokenize(eng.tokenize("Hello, world!")) == "Hello, world!"


async def test_greedy_is_deterministic(model_eng: engine.Engine) -> None:
    eng = model_eng
    first = await run(eng, request(PROMPTS[0]))
    second = await run(eng, request(PROMPTS[0]))
    assert first[1] == second[1]
    assert len(first[1]) == 16 and first[0].strip()


async def test_greedy_is_batch_invariant(model_eng: engine.Engine) -> None:
    """On both models: Gemma 3 270M's Q4_K_M has K-quant weights, whose ggml CPU matmul
    depends on the row count unless its tiled kernel is off (`loading.py`)."""
    eng = model_eng
    # Chat prompts that diverged within 48 tokens when the KV cache was one shared pool.
    for question in ("Write a haiku about rain.", "Name a fruit."):
        prompt = chat(eng, question)
        alone = await run(eng, request(prompt, max_new_tokens=48))
        batched = await run_all(
            eng, [request(p, max_new_tokens=48) for p in [*PROMPTS[:6], prompt, prompt]]
        )
        assert batched[6][1] == alone[1]
        assert batched[7][1] == alone[1]
    # Every other prompt in the batch got its own continuation.
    assert len({tuple(ids) for _, ids, _ in batched[:6]}) == 6


async def flush(eng: engine.Engine) -> None:
    """Empty the prefix cache once the requests that just ended have left the engine."""
    with trio.fail_after(10):
        while not eng.flush_cache():
            await trio.sleep(0.01)


async def test_prompt_chunks_of_one_length_are_decoded_together_and_keep_their_output(
    eng: engine.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of prompts of the same length is prefilled in one llama_decode, as
    llama-server batches it, and each prompt still gets exactly the tokens it gets alone;
    a prompt of another length gets a decode of its own."""
    questions = ["Write a haiku about rain.", "Name a fruit.", "Why is the sky blue?"]
    ids = [eng.tokenize(CHAT.format(q)) for q in questions]
    length = min(len(i) for i in ids)
    prompts = [i[:length] for i in ids] + [ids[0][: length - 3]]
    alone = [(await run(eng, ids_request(p, 24)))[1] for p in prompts]
    await flush(eng)  # else each prompt is restored whole: no prefill to batch
    graphs = await record_decodes(monkeypatch)
    together = await run_all(eng, [ids_request(p, 24) for p in prompts])
    assert [ids for _, ids, _ in together] == alone
    assert len({tuple(a) for a in alone}) == len(prompts)  # four different continuations
    # The three equal prompts in one decode, the shorter one in its own, then only decodes.
    assert graphs[:2] == [3 * length, length - 3]
    assert max(graphs[2:]) <= 4


async def test_a_burst_larger_than_one_decode_is_cut_into_decodes_of_equal_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a prefill budget above MAX_GRAPH_TOKENS, a step's equal-length chunks go in as
    many decodes as that cap needs (llama.cpp reserves compute memory for the whole ubatch),
    each prompt still getting exactly its own tokens."""
    from tributary.engine.runners.llama import MAX_GRAPH_TOKENS, batch_tokens

    config = EngineConfig(context_length=1024, max_running_requests=8, max_prefill_tokens=2048)
    assert batch_tokens(config) == MAX_GRAPH_TOKENS == 512
    async with engine.open_engine(config) as eng:
        base = eng.tokenize("The sea is wide, and the wind is cold. " * 30)
        prompts = [[1000 + i, *base[:199]] for i in range(8)]
        assert {len(p) for p in prompts} == {200}
        alone = [(await run(eng, ids_request(p, 8)))[1] for p in prompts]
        await flush(eng)  # else each prompt is restored whole: no prefill to batch
        graphs = await record_decodes(monkeypatch)
        together = await run_all(eng, [ids_request(p, 8) for p in prompts])
    # 8 prompts of 200 tokens in one step: two to a decode.
    assert graphs[:4] == [400, 400, 400, 400]
    assert [ids for _, ids, _ in together] == alone


async def test_plain_greedy_picks_what_llama_cpps_greedy_sampler_picks(
    model_eng: engine.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain greedy requests take the row's argmax with numpy; a zero logit bias keeps the
    same request on llama.cpp's sampler chain. Both give the same 64 tokens, for single
    prompts and in a batch, including a request whose EOS is suppressed (min_new_tokens)."""
    import llama_cpp

    chain_calls = 0
    sample = llama_cpp.llama_sampler_sample

    def counted(*args: object) -> int:
        nonlocal chain_calls
        chain_calls += 1
        return sample(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(llama_cpp, "llama_sampler_sample", counted)
    eng = model_eng
    prompts = [*PROMPTS[:4], chat(eng, "Name a fruit.")]
    for extra in ({}, {"min_new_tokens": 64}):
        plain = await run_all(eng, [request(p, max_new_tokens=64, **extra) for p in prompts])
        assert chain_calls == 0  # every token was the fast path's
        # A prompt restored whole samples its first token from the saved row, not through
        # llama_sampler_sample: flush, so that every first token is sampled after a prefill.
        await flush(eng)
        chained = await run_all(
            eng,
            [request(p, max_new_tokens=64, logit_bias={"7": 0.0}, **extra) for p in prompts],
        )
        # ... and here llama.cpp's sampler chose every token.
        assert chain_calls == sum(len(ids) for _, ids, _ in chained) > 5 * 32
        chain_calls = 0
        assert [ids for _, ids, _ in plain] == [ids for _, ids, _ in chained]
    assert eng._runner._argmax == set()  # type: ignore[attr-defined]  # closed slots leave


async def test_stop_string_is_trimmed(model_eng: engine.Engine, model_choice: str) -> None:
    eng = model_eng
    prompt, stop = STOPS[model_choice]
    text, _, _ = await run(eng, request(prompt))
    assert stop in text
    cut, _ids, done = await run(eng, request(prompt, stop=[stop]))
    assert done.finish_reason == {"type": "stop", "matched": stop}
    assert cut == text[: text.index(stop)]
    assert stop not in cut
    kept, _, _ = await run(eng, request(prompt, stop=[stop], no_stop_trim=True))
    assert kept == text[: text.index(stop) + len(stop)]


async def test_max_new_tokens_is_honoured(model_eng: engine.Engine) -> None:
    eng = model_eng
    for n in (1, 7, 33):
        _, ids, done = await run(eng, request(PROMPTS[1], max_new_tokens=n, ignore_eos=True))
        assert len(ids) == n == done.completion_tokens
        assert done.finish_reason == {"type": "length", "length": n}


async def test_eos_ends_a_chat_reply(eng: engine.Engine) -> None:
    text, ids, done = await run(
        eng, request(CHAT.format("What is the capital of France?"), max_new_tokens=200)
    )
    assert done.finish_reason == {"type": "stop", "matched": 2}  # <|im_end|>
    assert ids[-1] == 2 and done.completion_tokens == len(ids) < 200
    assert "<|im_end|>" not in text and text.strip()
    shown, _, _ = await run(
        eng,
        request(
            CHAT.format("What is the capital of France?"),
            max_new_tokens=200,
            skip_special_tokens=False,
        ),
    )
    assert shown == text  # the matched stop token is never rendered


async def test_seeded_sampling_repeats(eng: engine.Engine) -> None:
    params = {"temperature": 1.0, "top_p": 0.95, "sampling_seed": 1234, "max_new_tokens": 24}
    a = await run(eng, request(PROMPTS[1], **params))
    b = await run(eng, request(PROMPTS[1], **params))
    c = await run(eng, request(PROMPTS[1], **{**params, "sampling_seed": 99}))
    assert a[1] == b[1]
    assert a[1] != c[1]
    # Seeds at the edge of llama.cpp's 32-bit seeds (2**32 - 1 means "random" there) repeat too.
    for seed in (-1, 2**32 - 1, 2**40):
        same = [await run(eng, request(PROMPTS[1], **{**params, "sampling_seed": seed}))]
        same.append(await run(eng, request(PROMPTS[1], **{**params, "sampling_seed": seed})))
        assert same[0][1] == same[1][1], seed


async def test_temperature_scales_before_top_p_and_min_p(eng: engine.Engine) -> None:
    """SGLang's order: top-p and min-p cut the temperature-scaled distribution. At
    temperature 0.3 the top token of this prompt holds most of the mass, so top_p=0.5 and
    min_p=0.5 leave only it, whatever the seed."""
    _, greedy_ids, _ = await run(eng, request("Hello, my name is", max_new_tokens=1))
    for cut in ({"top_p": 0.5}, {"min_p": 0.5}):
        for seed in range(12):
            _, ids, _ = await run(
                eng,
                request(
                    "Hello, my name is",
                    max_new_tokens=1,
                    temperature=0.3,
                    sampling_seed=seed,
                    **cut,
                ),
            )
            assert ids == greedy_ids, (cut, seed)


async def test_utf8_multibyte_round_trips(eng: engine.Engine) -> None:
    text = "Grüße aus Köln — 東京タワー 🚀🌍 naïve café"
    assert eng.detokenize(eng.tokenize(text, add_special=False)) == text
    # Streamed deltas never split a character: every delta is valid text on its own, and
    # the emoji the prompt asks to repeat comes back whole.
    req = request(CHAT.format("Repeat exactly: 🚀🌍🚀🌍 東京"), max_new_tokens=40)
    async with eng.submit(req) as stream:
        deltas = [item.text async for item in stream]
    assert all("\ufffd" not in d for d in deltas)
    assert any(ch in "".join(deltas) for ch in "🚀🌍東京")


async def test_logit_bias_forces_and_forbids(model_eng: engine.Engine) -> None:
    eng = model_eng
    forced = eng.tokenize(" banana", add_special=False)[0]
    _, ids, _ = await run(eng, request(PROMPTS[0], max_new_tokens=4, logit_bias={str(forced): 100}))
    assert ids == [forced] * 4
    _, free_ids, _ = await run(eng, request(PROMPTS[0], max_new_tokens=4))
    _, banned, _ = await run(
        eng, request(PROMPTS[0], max_new_tokens=4, logit_bias={str(free_ids[0]): -100})
    )
    assert banned[0] != free_ids[0]


async def test_abort_mid_decode_frees_sequence_and_spares_others(model_eng: engine.Engine) -> None:
    eng = model_eng
    reqs = [request(p, max_new_tokens=48, ignore_eos=True) for p in PROMPTS[:4]]
    streams = [eng.submit(r) for r in reqs]
    victim = eng.submit(request(PROMPTS[4], max_new_tokens=400, ignore_eos=True))
    results: list[Done | None] = [None] * 4

    async def drain(i: int) -> None:
        async with streams[i] as stream:
            items = [item async for item in stream]
        results[i] = items[-1]  # type: ignore[assignment]

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(drain, i)
        async with victim:
            async for item in victim:
                if isinstance(item, Frame) and item.completion_tokens >= 5:
                    break
        assert eng.stats().running == 5  # the mark is acted on at the next step boundary
        with trio.fail_after(5):
            while eng.stats().running != 4:
                await trio.sleep(0.005)
        assert all(r is None for r in results)  # the others are still decoding
    for done in results:
        assert isinstance(done, Done)
        assert done.finish_reason == {"type": "length", "length": 48}
    stats = eng.stats()
    assert stats.running == 0 and stats.kv_used_cells == 0 and stats.waiting == 0


async def test_prompt_prefill_does_not_depend_on_its_neighbours(model_eng: engine.Engine) -> None:
    eng = model_eng
    """A long prompt gives the same greedy tokens alone and when another prompt is prefilled
    in the same step (this one diverged when chunks shared a llama_decode)."""
    story = "Once upon a time in a small village by the sea, there lived an old fisherman who " * 8
    prompt = chat(eng, story + "Who is the main character?")
    _, alone, _ = await run(eng, request(prompt, max_new_tokens=48))
    behind = await run_all(
        eng,
        [
            request(chat(eng, "Say hi " * 20), max_new_tokens=48),
            request(prompt, max_new_tokens=48),
        ],
    )
    assert behind[1][1] == alone


async def test_engine_exit_aborts_in_flight_requests_on_the_real_runner() -> None:
    """Leaving `open_engine` stops a busy llama scheduler at the next step boundary: the
    stream ends with the documented 503 abort, not by running to its length (a step is
    waited for shielded, so cancellation used to reach the loop only when it was idle)."""
    config = EngineConfig(context_length=1024, max_running_requests=2, threads=1)
    async with engine.open_engine(config) as eng:
        stream = eng.submit(request(PROMPTS[1], max_new_tokens=600, ignore_eos=True))
        first = await stream.__anext__()
        assert isinstance(first, Frame)
        steps_at_exit = eng.stats().steps
    rest = [item async for item in stream]
    stream.close()
    done = rest[-1]
    assert isinstance(done, Done)
    assert done.finish_reason["type"] == "abort" and done.finish_reason["status_code"] == 503
    assert done.completion_tokens < 20
    assert eng.stats().steps - steps_at_exit <= 2


@pytest.mark.parametrize("overlap", [True, False], ids=["decode-ahead", "plain"])
async def test_decodes_reuse_the_compute_graph(
    monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """llama-server reuses its compute graph from one decode to the next (without
    reuse it is ~4% slower). Tributary's decodes must get the same: one graph per shape, not
    one per step. llama.cpp counts reuses only with its perf counters on."""
    import llama_cpp

    contexts: list[object] = []
    create = llama_cpp.llama_init_from_model

    def with_perf_counters(model: object, params: llama_cpp.llama_context_params) -> object:
        params.no_perf = False
        ctx = create(model, params)
        contexts.append(ctx)
        return ctx

    monkeypatch.setattr(llama_cpp, "llama_init_from_model", with_perf_counters)
    config = EngineConfig(
        context_length=1024, max_running_requests=2, threads=1, overlap_decode=overlap
    )
    async with engine.open_engine(config) as eng:
        llama_cpp.llama_perf_context_reset(contexts[0])
        _, ids, _ = await run(eng, request("Tell me about dragons.", max_new_tokens=40))
        perf = llama_cpp.llama_perf_context(contexts[0])
    assert len(ids) == 40
    # Every single-token decode after the first reuses the graph the previous one built.
    assert perf.n_eval >= 39
    assert perf.n_reused >= perf.n_eval - 2


@pytest.mark.skipif(
    not collapse_available(), reason="this kernel does not collapse memory into huge pages"
)
async def test_weights_are_read_into_huge_pages_unless_mapped() -> None:
    """By default the weights are read into the process's own memory and moved into 2 MiB
    pages (docs/benchmarks/README.md, "Weights in huge pages"); `mmap_weights` maps the file
    as llama.cpp does. Either way the model answers the same."""
    import llama_cpp

    from tributary.engine.core import open_runner
    from tributary.engine.runners.hugepages import HUGE_PAGE
    from tributary.engine.runners.llama import LlamaRunner

    answers = []
    for mmap_weights in (False, True):
        config = EngineConfig(
            context_length=1024, max_running_requests=1, threads=1, mmap_weights=mmap_weights
        )
        runner = await open_runner(config)
        assert isinstance(runner, LlamaRunner)
        pages = runner.huge_pages
        mapped = runner.info.path in Path("/proc/self/maps").read_text()
        assert mapped == mmap_weights
        if mmap_weights:
            assert pages is None
        else:
            assert pages is not None and pages.error is None, pages
            # All of the weights but the ends of their buffer that share a huge page with
            # other memory.
            assert pages.huge >= llama_cpp.llama_model_size(runner._model) - 2 * HUGE_PAGE
        async with engine.open_engine(config, runner=runner) as eng:
            _, ids, _ = await run(eng, request("The capital of France is", max_new_tokens=24))
        answers.append(ids)
    assert len(answers[0]) == 24 and answers[0] == answers[1]
