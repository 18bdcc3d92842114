"""Weight repacking (`--repack-weights`): "auto" repacks unless llama.cpp was compiled with
AMX, whose repacked weights crash every decode, or the model has weights whose repacked
kernels break batch invariance (Q4_K), and says why in one log line; "on" is refused with
AMX; `/get_server_info` reports what was done. The AMX cases fake llama.cpp's system info,
so they run on any build (faking the other way round would crash an AMX build: those tests
need `just setup`'s AMX-free llama.cpp and skip elsewhere)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import httpx
import llama_cpp
import pytest
import trio

from tributary import engine, testing
from tributary.app.cli import build_parser, configs, main
from tributary.engine import EngineConfig, GenerateRequest, SamplingParams
from tributary.engine.repack import AMX_MARK, choose_repack, weight_buffers
from tributary.engine.runners.llama import loading

AMX_INFO = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 | REPACK = 1 | "
NO_AMX_INFO = AMX_INFO.replace("AMX_INT8 = 1 | ", "")

CONFIG = EngineConfig(context_length=512, max_running_requests=2, prefix_cache_mb=0)
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

amx_free = pytest.mark.skipif(
    AMX_MARK in loading.llama_system_info(),
    reason="this llama.cpp was compiled with AMX, which crashes with repacked weights "
    "(`just setup` installs one without)",
)


def repack_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "repack" in r.getMessage()]


Q4_0 = frozenset({"F32", "Q4_0", "Q8_0"})
Q4_K_M = frozenset({"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"})


def test_auto_repacks_only_without_amx_and_says_how_to_get_it() -> None:
    assert choose_repack("auto", NO_AMX_INFO, Q4_0).enabled
    fallback = choose_repack("auto", AMX_INFO, Q4_0)
    assert not fallback.enabled and fallback.llama_cpp_amx and fallback.warn
    assert "compiled with AMX" in fallback.reason
    assert "`just setup`" in fallback.reason and "-mno-amx-int8" in fallback.reason
    assert not choose_repack(False, NO_AMX_INFO, Q4_0).enabled
    assert choose_repack(True, NO_AMX_INFO, Q4_0).enabled


def test_auto_does_not_repack_when_the_build_lists_no_cpu_features() -> None:
    """A llama.cpp that loads its CPU backend later (GGML_BACKEND_DL) lists none yet, so
    AMX cannot be ruled out."""
    unknown = choose_repack("auto", "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | ", Q4_0)
    assert not unknown.enabled and unknown.warn and "unknown" in unknown.reason
    assert choose_repack(True, "", Q4_0).enabled


def test_auto_leaves_weights_whose_repacked_kernels_break_batch_invariance() -> None:
    kept = choose_repack("auto", NO_AMX_INFO, Q4_K_M)
    assert not kept.enabled and not kept.warn
    assert kept.reason == (
        "weights not repacked: llama.cpp's repacked Q4_K kernels make a sequence's greedy "
        "output depend on the batch beside it (--repack-weights on repacks anyway)"
    )
    forced = choose_repack(True, NO_AMX_INFO, Q4_K_M)
    assert forced.enabled and forced.warn and "batch beside it" in forced.reason
    # Other CPUs run other repacked kernels, not measured: auto leaves them alone.
    assert not choose_repack("auto", NO_AMX_INFO, Q4_0, "aarch64").enabled


def test_the_gguf_tensor_table_gives_the_weight_types() -> None:
    assert loading.weight_types(loading.default_model_path()) == {"F32", "Q4_1", "Q8_0"}


def test_repacking_asked_of_an_amx_build_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--repack-weights on: this llama.cpp was compiled"):
        choose_repack(True, AMX_INFO, Q4_0)


def test_weight_buffers_are_read_from_llamas_log() -> None:
    log = (
        "load_tensors: loading model tensors, this can take a while... (mmap = false)\n"
        "load_tensors:          CPU model buffer size =    27.00 MiB\n"
        "load_tensors:   CPU_REPACK model buffer size =    58.50 MiB\n"
    )
    assert weight_buffers(log) == {"CPU": 27.0, "CPU_REPACK": 58.5}


@pytest.mark.parametrize(
    ("flags", "setting"),
    [([], "auto"), (["--repack-weights", "on"], True), (["--repack-weights", "off"], False),
     (["--no-repack"], False), (["-nr"], False)],
)  # fmt: skip
def test_the_flag_sets_the_engine_setting(flags: list[str], setting: object) -> None:
    args = build_parser().parse_args(["serve", *flags])
    assert configs(args)[0].repack_weights == setting


def test_a_bad_flag_value_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--repack-weights", "yes"])
    assert "invalid choice: 'yes'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="repack_weights must be True, False or auto, got 1"):
        EngineConfig(repack_weights=1)  # type: ignore[arg-type]


def test_serve_refuses_repack_on_with_an_amx_build_before_loading(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(loading, "llama_system_info", lambda: AMX_INFO)
    assert main(["serve", "--port", "0", "--repack-weights", "on"]) == 2
    err = capsys.readouterr().err
    assert "tributary: error: --repack-weights on: this llama.cpp was compiled with AMX" in err
    assert "just setup" in err


@pytest.mark.model
async def test_an_amx_build_loads_unrepacked_with_one_line_saying_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(loading, "llama_system_info", lambda: AMX_INFO)
    caplog.set_level(logging.INFO, logger="tributary.engine.llama")
    async with testing.open_server(CONFIG) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            info = (await client.get("/get_server_info")).json()
            answer = await client.post(
                "/generate", json={"text": "The capital of France is", "sampling_params": {
                    "temperature": 0, "max_new_tokens": 8}},
            )  # fmt: skip
    assert answer.status_code == 200 and answer.json()["text"]
    [line] = repack_records(caplog)
    assert line.levelno == logging.WARNING
    assert line.getMessage().startswith("weights not repacked: this llama.cpp was compiled")
    assert "`just setup`" in line.getMessage()
    repack = info["weights_repack"]
    assert info["repack_weights"] == "auto"
    assert repack["setting"] == "auto" and repack["llama_cpp_amx"] is True
    assert repack["enabled"] is False and repack["repacked"] is False
    assert repack["repacked_mib"] == 0 and sum(repack["buffers_mib"].values()) > 50
    assert repack["reason"] == line.getMessage()


@pytest.mark.model
@amx_free
async def test_the_default_model_decodes_the_same_text_repacked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SmolLM2's Q4_1 matmul weights have no repacked kernel on x86, so llama.cpp repacks
    none of them (its Q8_0 embeddings neither): the same greedy text, and the log says so."""
    caplog.set_level(logging.INFO, logger="tributary.engine.llama")
    prompts = [CHAT.format("Write a haiku about rain."), "The three primary colors are"]
    greedy = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 32})
    async with engine.open_engine(CONFIG) as eng:
        on = [await tokens(eng, [p], greedy) for p in prompts]
        assert eng.model_info.weights_repack is not None
        assert eng.model_info.weights_repack.choice.enabled
    [line] = repack_records(caplog)
    assert line.levelno == logging.INFO
    assert "(auto: no AMX): none has one in this model (CPU " in line.getMessage()
    unrepacked = dataclasses.replace(CONFIG, repack_weights=False)
    async with engine.open_engine(unrepacked) as eng:
        off = [await tokens(eng, [p], greedy) for p in prompts]
    assert on == off and all(ids[0] for ids in on)


@pytest.mark.model
@amx_free
async def test_repacked_q4_0_weights_keep_greedy_output_batch_invariant(tmp_path: Path) -> None:
    """A Q4_0 copy of SmolLM2 (llama.cpp's own quantizer) is repacked by default, and a
    sequence decodes the same tokens alone (ggml's gemv kernel) as beside 4 others (its
    4-row gemm for 4 of them, gemv for the fifth)."""
    path = tmp_path / "SmolLM2-135M-Instruct.Q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    source = str(loading.default_model_path()).encode()
    assert llama_cpp.llama_model_quantize(source, str(path).encode(), params) == 0
    config = EngineConfig(model_path=str(path), context_length=512, max_running_requests=5)
    prompts = [CHAT.format(q) for q in ("Write a haiku about rain.", "Name a fruit.",
               "Why is the sky blue?", "What is a prime number?", "Describe a cat.")]  # fmt: skip
    greedy = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 24})
    async with engine.open_engine(config) as eng:
        repack = eng.model_info.weights_repack
        assert repack is not None and repack.repacked_mib > 50
        alone = [await tokens(eng, [p], greedy) for p in prompts[:2]]
        together = await tokens(eng, prompts, greedy)
    assert together[:2] == [a[0] for a in alone]
    assert len({tuple(t) for t in together}) == 5


async def tokens(eng: engine.Engine, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    """Each prompt's output ids, all submitted at once (so decoded in one batch)."""
    streams = [eng.submit(GenerateRequest(text=p, sampling=params)) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]

    async def drain(i: int) -> None:
        async with streams[i] as stream:
            async for item in stream:
                assert not isinstance(item, engine.Error), item.error
                out[i] += item.output_ids

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(drain, i)
    return out
