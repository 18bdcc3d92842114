"""Embeddings on the real model (SmolLM2-135M-Instruct, which declares no pooling, so
`pooling` is set): batch invariance, llama.cpp's own pooling as the reference, the checks
before anything is computed, and generation left untouched."""

from __future__ import annotations

import ctypes
from collections.abc import AsyncIterator

import llama_cpp
import numpy as np
import pytest
import trio
import trio.testing

from tributary import engine
from tributary.engine import (
    BadRequest,
    Capabilities,
    Done,
    EngineConfig,
    Frame,
    GenerateRequest,
    SamplingParams,
)
from tributary.engine.embeddings import EmbeddingAborted
from tributary.engine.errors import EngineClosed
from tributary.engine.kv_memory import InsufficientMemory
from tributary.engine.placement import Placement
from tributary.engine.runners.llama import default_model_path

pytestmark = pytest.mark.model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings turn text into vectors.",
    "Paris is the capital of France.",
]
#: Longer than one decode of the embedding context (a prompt chunk, 64 tokens here), so it
#: is embedded in pieces whose KV carries over.
LONG = " ".join(TEXTS * 12)
CHUNK = 64


def config(pooling: str | None = "mean", **extra: object) -> EngineConfig:
    return EngineConfig(
        context_length=1024,
        max_running_requests=2,
        prefill_chunk_tokens=CHUNK,
        prefix_cache_mb=0,
        threads=1,
        pooling=pooling,  # type: ignore[arg-type]
        **extra,  # type: ignore[arg-type]
    )


@pytest.fixture
async def eng() -> AsyncIterator[engine.Engine]:
    async with engine.open_engine(config()) as eng:
        yield eng


def ids_of(eng: engine.Engine, text: str) -> list[int]:
    return eng.tokenize(text, add_special=True)


async def test_a_text_gets_the_same_vector_alone_and_in_a_batch(eng: engine.Engine) -> None:
    service = Capabilities.of(eng).embeddings
    assert service is not None
    inputs = [ids_of(eng, t) for t in [*TEXTS, LONG]]
    assert len(inputs[-1]) > 2 * CHUNK, "the long text spans several decodes"
    batch = await service.embed(inputs)
    for ids, batched in zip(inputs, batch, strict=True):
        [alone] = await service.embed([ids])
        # Every decode starts from an empty KV cache and a long input is decoded alone, in
        # the same pieces: the same computation, so the same floats (no tolerance needed;
        # measured identical). 1e-6 leaves room only for a BLAS that blocks by batch rows.
        np.testing.assert_allclose(alone, batched, rtol=0, atol=1e-6)
        assert alone.dtype == np.float32 and alone.shape == (576,)
        assert np.linalg.norm(alone) == pytest.approx(1.0, abs=1e-5)
    # Different texts, different vectors.
    assert float(batch[0] @ batch[1]) < 0.999


def reference(text: str, pooling: int, ubatch: int = 1024) -> np.ndarray:
    """llama.cpp's own pooling: a fresh model and context with `pooling_type` set, the text
    in one `llama_decode` that llama.cpp cuts into ubatches of `ubatch` tokens, its sequence
    embedding L2-normalised (llama-server's default)."""
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = False  # repacking crashes decodes on these CPUs (architecture.md)
    model = llama_cpp.llama_model_load_from_file(str(default_model_path()).encode(), params)
    assert model
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        data = text.encode()
        buf = (llama_cpp.llama_token * 4096)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, 4096, True, True)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = 1024
        cparams.n_ubatch = ubatch
        cparams.embeddings = True
        cparams.pooling_type = pooling
        cparams.n_threads = cparams.n_threads_batch = 1
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        assert ctx
        try:
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(buf, n)) == 0
            width = llama_cpp.llama_model_n_embd(model)
            pointer = ctypes.cast(
                llama_cpp.llama_get_embeddings_seq(ctx, 0), ctypes.POINTER(ctypes.c_float)
            )
            vector = np.ctypeslib.as_array(pointer, shape=(width,)).copy()
        finally:
            llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)
    return vector / np.linalg.norm(vector)


@pytest.mark.parametrize(
    ("pooling", "number"),
    [
        ("mean", llama_cpp.LLAMA_POOLING_TYPE_MEAN),
        ("last", llama_cpp.LLAMA_POOLING_TYPE_LAST),
        ("cls", llama_cpp.LLAMA_POOLING_TYPE_CLS),
    ],
)
async def test_vectors_match_llama_cpp_pooling(pooling: str, number: int) -> None:
    async with engine.open_engine(config(pooling)) as eng:
        service = Capabilities.of(eng).embeddings
        assert service is not None and service.model.pooling == pooling
        short, long = await service.embed([ids_of(eng, TEXTS[0]), ids_of(eng, LONG)])
    # One decode here and there: the same computation; 1e-5 leaves room for summing the
    # mean in another order (here float64 over rows, there llama.cpp's float32 matmul).
    expected = await trio.to_thread.run_sync(reference, TEXTS[0], number)
    np.testing.assert_allclose(short, expected, rtol=0, atol=1e-5)
    if pooling == "last":
        # llama.cpp pools "last" right across ubatches: cut into the same 64-token pieces,
        # it computes what this server does.
        expected = await trio.to_thread.run_sync(reference, LONG, number, CHUNK)
        np.testing.assert_allclose(long, expected, rtol=0, atol=1e-5)
    # Against the whole text in one decode (llama.cpp pools "mean" and "cls" per ubatch, so
    # only a single one is right for them): chunked prefill itself moves the last bits of
    # every layer (llama.cpp's "last" of this text, whole vs in 64-token ubatches: cosine
    # 0.9998, 6e-3 at most), so the vectors agree to that, not to float precision. Another
    # pooling gives cosines of 0.63 and less for this text.
    whole = await trio.to_thread.run_sync(reference, LONG, number)
    assert float(long @ whole) > 0.999


async def test_a_model_without_pooling_refuses_naming_the_flag() -> None:
    async with engine.open_engine(config(None)) as eng:
        service = Capabilities.of(eng).embeddings
        assert service is not None and service.model.pooling is None
        assert service.model.pooling_source == "gguf"
        with pytest.raises(
            BadRequest, match=r"declares no pooling type.*--pooling mean, last or cls"
        ):
            await service.embed([ids_of(eng, "hi")])


async def test_bad_inputs_are_400s_before_anything_is_computed(
    eng: engine.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = Capabilities.of(eng).embeddings
    assert service is not None
    decoded: list[object] = []
    monkeypatch.setattr(llama_cpp, "llama_decode", lambda *a: decoded.append(a) or 0)
    vocab = eng.model_info.vocab_size
    cases = {
        "the input list is empty": [],
        "Input 1 is empty": [[1], []],
        "Input 0 has 1025 tokens, more than this model embeds in one input \\(1024": [[1] * 1025],
        f"Input 0 has token id {vocab}, outside the vocabulary": [[1, vocab]],
        "Input 0 has token id -1": [[-1]],
        "At most 2048 inputs": [[1]] * 2049,
        # OpenAI's bound per request: one request would hold up every other for ~20 s.
        "The inputs have 300150 tokens in all, more than one request may embed \\(300000": [
            [1] * 150
        ]
        * 2001,
    }
    for message, inputs in cases.items():
        with pytest.raises(BadRequest, match=message):
            await service.embed(inputs)
    assert decoded == []


async def test_a_cancelled_embedding_ends_after_the_decode_running(
    eng: engine.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that leaves, or a deadline, cancels the call: it ends after the decode that is
    running, not after every decode the request needed, and the next request is not held up."""
    service = Capabilities.of(eng).embeddings
    assert service is not None
    long = [100 + i % 500 for i in range(16 * CHUNK)]  # 16 decodes each
    [before] = await service.embed([long[:10]])
    token = trio.lowlevel.current_trio_token()
    decoded: list[int] = []
    real = llama_cpp.llama_decode

    def decode(ctx: object, batch: llama_cpp.llama_batch) -> int:
        decoded.append(batch.n_tokens)
        if len(decoded) == 2:  # the client leaves while the second decode runs
            trio.from_thread.run_sync(scope.cancel, trio_token=token)
        return int(real(ctx, batch))

    monkeypatch.setattr(llama_cpp, "llama_decode", decode)
    with trio.CancelScope() as scope:
        await service.embed([long] * 4)
    assert scope.cancelled_caught
    assert len(decoded) == 2, f"{len(decoded)} of 64 decodes ran for a request that left"
    [after] = await service.embed([long[:10]])
    assert np.array_equal(after, before)


async def test_a_context_shorter_than_a_prompt_chunk_embeds_short_inputs_together() -> None:
    # Short inputs share a decode of up to a prompt chunk (256 tokens by default); llama.cpp
    # makes a decode no longer than the context (64 here), so they must not add up past it.
    tiny = EngineConfig(context_length=64, prefix_cache_mb=0, threads=1, pooling="mean")
    async with engine.open_engine(tiny) as eng:
        service = Capabilities.of(eng).embeddings
        assert service is not None
        inputs = [[100 + i + k for i in range(60)] for k in range(4)]
        together = await service.embed(inputs)
        for ids, vector in zip(inputs, together, strict=True):
            [alone] = await service.embed([ids])
            np.testing.assert_allclose(alone, vector, rtol=0, atol=1e-6)


async def greedy_tokens(
    eng: engine.Engine, prompt: str, seen: list[int] | None = None
) -> list[int]:
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 48, "ignore_eos": True})
    out = seen if seen is not None else []
    async with eng.submit(GenerateRequest(text=prompt, sampling=params, stream=True)) as stream:
        async for item in stream:
            assert isinstance(item, Frame | Done)
            out += item.output_ids
    return out


async def test_embeddings_beside_a_generation_leave_its_greedy_output_unchanged(
    eng: engine.Engine,
) -> None:
    service = Capabilities.of(eng).embeddings
    assert service is not None
    prompt = "Write a long story about a robot who learns to paint."
    inputs = [ids_of(eng, t) for t in [*TEXTS, LONG]]
    await service.embed(inputs)  # the embedding context exists before the generation starts
    alone = await greedy_tokens(eng, prompt)
    beside: list[int] = []
    during: list[int] = []  # tokens the generation had when each embedding call ended
    done = trio.Event()

    async def generate() -> None:
        await greedy_tokens(eng, prompt, beside)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(generate)
        while not done.is_set() and len(during) < 3:  # embed while it decodes
            await service.embed(inputs)
            during.append(len(beside))
    assert len([n for n in during if 0 < n < len(alone)]) >= 2, f"not interleaved: {during}"
    assert beside == alone


async def test_the_sim_runner_embeds_fake_vectors_with_the_same_checks() -> None:
    async with engine.open_engine(EngineConfig(runner="sim", context_length=64)) as eng:
        service = Capabilities.of(eng).embeddings
        assert service is not None
        assert service.model.pooling_source == "sim" and service.model.dimensions == 16
        a, b, again = await service.embed([[1, 2, 3], [4, 5], [1, 2, 3]])
        assert np.array_equal(a, again) and not np.array_equal(a, b)
        assert np.linalg.norm(a) == pytest.approx(1.0, abs=1e-6)
        with pytest.raises(BadRequest, match="Input 0 has 65 tokens"):
            await service.embed([[1] * 65])


SHUTTING_DOWN = "The server is shutting down."


async def test_shutdowns_aborts_end_waiting_embeddings_at_once_and_the_running_one_after_its_decode(
    eng: engine.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a graceful shutdown does (app/server.py `abort_leftovers`): `abort_waiting`, then
    `abort_all` near the deadline. Each embedding request ends with the 503 a generation
    gets, not cut off at the deadline with no answer."""
    service = Capabilities.of(eng).embeddings
    assert service is not None
    long = [100 + i % 500 for i in range(16 * CHUNK)]  # 16 decodes
    token = trio.lowlevel.current_trio_token()
    decoded: list[int] = []
    real = llama_cpp.llama_decode
    outcomes: dict[str, object] = {}

    def decode(ctx: object, batch: llama_cpp.llama_batch) -> int:
        decoded.append(batch.n_tokens)
        if len(decoded) == 2:
            trio.from_thread.run_sync(
                lambda: eng.abort_waiting(message=SHUTTING_DOWN, status_code=503),
                trio_token=token,
            )
        if len(decoded) == 4:
            trio.from_thread.run_sync(
                lambda: eng.abort_all(message=SHUTTING_DOWN, status_code=503), trio_token=token
            )
        return int(real(ctx, batch))

    async def embed(name: str, inputs: list[list[int]]) -> None:
        try:
            outcomes[name] = await service.embed(inputs)
        except EmbeddingAborted as error:
            outcomes[name] = (error.http_status, error.message, len(decoded))

    monkeypatch.setattr(llama_cpp, "llama_decode", decode)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(embed, "running", [long])
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(embed, "waiting", [long[:10]])
    assert outcomes["waiting"] == (503, SHUTTING_DOWN, 2), "ended when abort_waiting ran"
    assert outcomes["running"] == (503, SHUTTING_DOWN, 4), "ended after the decode in flight"
    [vector] = await service.embed([long[:10]])  # not a shutdown: the next one is computed
    assert vector.shape == (576,)


async def test_stop_decoding_gives_up_the_embedding_decode_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Closing the engine (or its `stop_decoding`) stops an embedding decode at llama.cpp's
    next graph node, as a generation's: shutdown waited ~2 s for one big chunk otherwise."""
    statuses: list[int] = []
    async with engine.open_engine(config()) as eng:
        service = Capabilities.of(eng).embeddings
        assert service is not None
        runner = eng._runner
        real = llama_cpp.llama_decode

        def decode(ctx: object, batch: llama_cpp.llama_batch) -> int:
            runner.stop_decoding()  # type: ignore[attr-defined]  # the engine closes now
            statuses.append(int(real(ctx, batch)))
            return statuses[-1]

        monkeypatch.setattr(llama_cpp, "llama_decode", decode)
        with pytest.raises(EngineClosed, match="shutting down"):
            await service.embed([ids_of(eng, TEXTS[0])])
        monkeypatch.undo()
    assert statuses == [2], "llama_decode's status for a decode its abort callback stopped"


async def test_an_embedding_decode_counts_among_the_steps_an_abort_may_wait_for(
    eng: engine.Engine,
) -> None:
    """A generation step queues behind an embedding decode on the compute thread, so the
    shutdown margin (`slowest_recent_step`) counts embedding decodes too."""
    service = Capabilities.of(eng).embeddings
    assert service is not None
    assert eng.slowest_recent_step() == 0.0
    await service.embed([[100 + i % 500 for i in range(CHUNK)]])
    assert eng.slowest_recent_step() > 0.0


async def test_the_embedding_context_is_made_at_load_sized_by_its_flag_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a pooling type the embedding context is made at load (a failure is a start-up
    error) with KV for `embedding_context_length` tokens, and the start-up memory check
    counts it; without one, nothing is made."""
    made: list[int] = []
    real = llama_cpp.llama_init_from_model

    def init(model: object, params: llama_cpp.llama_context_params) -> object:
        made.append(params.n_ctx if params.embeddings else 0)
        return real(model, params)

    monkeypatch.setattr(llama_cpp, "llama_init_from_model", init)
    async with engine.open_engine(config(embedding_context_length=128)) as eng:
        assert made == [0, 128], "generation's context, then the embedding one, at load"
        service = Capabilities.of(eng).embeddings
        assert service is not None and service.model.max_input_tokens == 128
        with pytest.raises(BadRequest, match=r"129 tokens.*\(128 tokens, --embedding-context"):
            await service.embed([[1] * 129])
        weights = llama_cpp.llama_model_size(eng._runner._model)  # type: ignore[attr-defined]
        generation = eng._runner.kv_bytes  # type: ignore[attr-defined]
        embedding = eng._runner.embedding_kv_bytes  # type: ignore[attr-defined]
        # SmolLM2: 30 layers x (3 + 3 KV heads x 64) x 2 bytes (f16) a cell.
        assert embedding == 128 * 30 * 2 * 192 * 2 and generation == 2 * 1024 * 30 * 2 * 192 * 2
    made.clear()
    async with engine.open_engine(config(None)) as eng:
        assert made == [0], "no pooling type: no embedding context"
        assert eng._runner.embedding_kv_bytes == 0  # type: ignore[attr-defined]
    # Room for the weights and generation's KV but not the embedding context's: refused.
    from tributary.engine.runners.llama import runner as llama_runner

    monkeypatch.setattr(
        llama_runner, "mem_available", lambda: weights + generation + embedding // 2
    )
    with pytest.raises(InsufficientMemory, match=r"for embeddings \(--embedding-context-length"):
        async with engine.open_engine(config(embedding_context_length=128)):
            pass


def test_the_placement_plan_counts_the_embedding_contexts_kv() -> None:
    """The KV placed on GPUs (or counted in host memory) is generation's plus the embedding
    context's, where there is a pooling type."""
    from tributary.engine.runners.llama.devices import plan_for

    path = default_model_path()
    cell = 30 * 2 * 192 * 2  # SmolLM2 at f16
    plain = plan_for(path, config(None))
    pooled = plan_for(path, config(embedding_context_length=128))

    def kv(plan: Placement) -> int:
        return plan.host_kv_bytes + sum(share.kv_bytes for share in plan.devices)

    assert kv(plain) == 2 * 1024 * cell
    assert kv(pooled) == (2 * 1024 + 128) * cell
