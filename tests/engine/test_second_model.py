"""Models served by name (engine/models.py), and what a second model family changes: the
logprobs the engine reports are llama.cpp's own for each model, Gemma 3's sliding-window
attention included."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from tributary import engine
from tributary.app.cli import build_parser, configs
from tributary.engine import EngineConfig, GenerateRequest, LogprobRequest, SamplingParams
from tributary.engine.models import MODELS, ModelNotInstalled, named_model, resolve_model_path
from tributary.engine.prefix_cache import PrefixCache
from tributary.engine.runners.sim import SimKVState

PROMPT = "The three primary colors are red, yellow and blue. The three secondary colors are"


def test_serve_takes_a_model_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--model", "gemma3-270m"])
    assert configs(args)[0].model_path == "gemma3-270m"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "a model shipped on PyPI by name: smollm2-135m, gemma3-270m" in help_text


def test_a_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    for name in ("gemma3-270m", "smollm2-135m"):
        with pytest.raises(ModelNotInstalled) as caught:
            resolve_model_path(name)
        assert f"pip install {MODELS[name].package}" in str(caught.value)


def test_an_unknown_name_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"one of smollm2-135m, gemma3-270m"):
        resolve_model_path("gemma9-1t")
    # A file of that name is the file, not the registered model.
    local = tmp_path / "gemma3-270m"
    local.write_bytes(b"GGUF")
    assert resolve_model_path(str(local)) == local
    assert named_model(None) is MODELS["smollm2-135m"]


def llama_cpp_logprobs(path: Path, tokens: list[int]) -> np.ndarray:
    """log-softmax rows for positions 0..n-2 of `tokens`, from llama.cpp directly: one decode
    of the whole prompt with a context made as the runner makes it (no flash attention for a
    sliding-window model, no weight repacking)."""
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    ctx_params = llama_cpp.llama_context_default_params()
    ctx_params.n_ctx = ctx_params.n_batch = ctx_params.n_ubatch = 512
    ctx_params.n_threads = ctx_params.n_threads_batch = 1
    if llama_cpp.llama_model_n_swa(model):
        ctx_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = llama_cpp.llama_init_from_model(model, ctx_params)
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1
        assert llama_cpp.llama_decode(ctx, batch) == 0
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        rows = np.ctypeslib.as_array(
            ctypes.cast(llama_cpp.llama_get_logits(ctx), ctypes.POINTER(ctypes.c_float)),
            shape=(len(tokens), n_vocab),
        ).astype(np.float64)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    rows = rows[:-1]
    top = rows.max(axis=1, keepdims=True)
    return rows - top - np.log(np.exp(rows - top).sum(axis=1, keepdims=True))


@pytest.mark.model
async def test_prompt_logprobs_are_llama_cpps_own(model_choice: str) -> None:
    config = EngineConfig(model_path=model_choice, context_length=512, max_running_requests=1)
    async with engine.open_engine(config) as eng:
        tokens = eng.tokenize(PROMPT)
        request = GenerateRequest(
            input_ids=tokens,
            sampling=SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1}),
            logprobs=LogprobRequest(start_len=0, top_n=5),
        )
        async with eng.submit(request) as stream:
            items = [item async for item in stream]
        path = Path(eng.model_info.path)
    scored = items[0].logprobs
    assert scored is not None and scored.input_token is not None and scored.input_top
    expected = llama_cpp_logprobs(path, tokens)
    assert [token for _, token in scored.input_token] == tokens
    assert scored.input_token[0][0] is None  # nothing precedes the first token
    got = np.array([logprob for logprob, _ in scored.input_token[1:]], dtype=np.float64)
    want = expected[np.arange(len(tokens) - 1), tokens[1:]]
    np.testing.assert_allclose(got, want, atol=2e-3)
    for position, top in enumerate(scored.input_top[1:]):
        assert top is not None
        assert [token for _, token in top] == list(np.argsort(-expected[position])[:5])


@pytest.mark.model
async def test_grammars_hold_on_every_vocabulary(model_choice: str) -> None:
    """llguidance's token masks are built from each model's own vocabulary (SmolLM2's BPE of
    49,152 tokens, Gemma's SentencePiece of 262,144): a regex, a JSON Schema and a GBNF
    grammar each bind the greedy output."""
    schema = {
        "type": "object",
        "properties": {
            # Bounded: unbounded, Gemma's greedy digits can run past max_new_tokens.
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    config = EngineConfig(model_path=model_choice, context_length=512, max_running_requests=3)
    cases = {
        "regex": r"[0-9]{3}-[0-9]{4}",
        "json_schema": json.dumps(schema),
        "ebnf": 'root ::= "yes" | "no"',
    }
    async with engine.open_engine(config) as eng:
        outputs = {}
        for key, grammar in cases.items():
            params = SamplingParams.from_dict(
                {"temperature": 0, "max_new_tokens": 48, key: grammar}
            )
            request = GenerateRequest(text="Tell me about Ada, 36, at 555-0199:", sampling=params)
            async with eng.submit(request) as stream:
                items = [item async for item in stream]
            assert isinstance(items[-1], engine.Done), items[-1]
            outputs[key] = "".join(item.text for item in items)
    assert re.fullmatch(cases["regex"], outputs["regex"]), outputs
    person = json.loads(outputs["json_schema"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int), outputs
    assert 0 <= person["age"] <= 150, outputs
    assert outputs["ebnf"] in ("yes", "no"), outputs


def test_a_window_limits_which_prefixes_an_entry_serves() -> None:
    """With a sliding window of 8 positions (chunks of 4), an entry of 12 tokens serves only
    its own length: a shorter prefix is neither looked up in it nor counted as held, so it is
    stored beside it, and a longer entry no longer replaces it. Entries of up to 8 tokens
    serve their prefixes as without a window."""
    cache = PrefixCache(capacity_bytes=1 << 20, chunk=4, window=8)
    tokens = list(range(100, 116))
    assert cache.insert(tokens[:12], SimKVState(tuple(tokens[:12]), 12))
    assert cache.lookup(tokens[:9]) is None  # 8 of the 12 would be a cut past the window
    hit = cache.lookup(tokens[:13])
    assert hit is not None and hit.n_tokens == 12  # the whole entry
    assert not cache.holds(tokens[:8]) and cache.holds(tokens[:12])
    assert cache.insert(tokens[:8], SimKVState(tuple(tokens[:8]), 8))
    assert len(cache) == 2  # the 12-token entry did not make it redundant
    hit = cache.lookup(tokens[:6])
    assert hit is not None and hit.n_tokens == 4 and len(hit.entry.tokens) == 8
    assert cache.insert(tokens[:16], SimKVState(tuple(tokens[:16]), 16))
    assert len(cache) == 3  # nor does a longer one
    assert not cache.insert(tokens[:4], SimKVState(tuple(tokens[:4]), 4))  # the 8 serves it
