"""`cached_tokens` over HTTP on the real model (SGLang's endpoint test, checklist item 11,
scaled to 256-token chunks, with prompts seen before restored whole), in every response
shape and in `/v1` usage; and `/flush_cache`, which empties the prefix cache and refuses
(400, SGLang's words) while requests run."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from apphelpers import Server, parse_sse, running_server, sim_config, two_stream_modes, wait_until

from tributary.app.sglang.admin import FLUSH_CACHE_MESSAGE
from tributary.engine import EngineConfig

#: Small context so the model loads fast; one thread (see test_generate_model.py).
MODEL = EngineConfig(context_length=4096, max_running_requests=4, threads=1)


def ids(n: int) -> list[int]:
    return list(range(100, 100 + n))


def body(n: int, **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": ids(n),
        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        **extra,
    }


#: `cached_tokens` of the prompts of 100, 2000, 2000, 1000 and 2200 tokens, then of a batch
#: of 600 and 700. The second 2000 is restored whole. Gemma 3's sliding window (512) lets a
#: snapshot longer than it serve only its own length (engine/prefix_cache.py): 1000 cannot
#: start from the 2000 entry, nor the batch from the 768 one.
EXPECTED = {
    "smollm2-135m": ([0, 0, 2000, 768, 1792], [512, 512]),
    "gemma3-270m": ([0, 0, 2000, 0, 1792], [0, 0]),
}


@pytest.fixture
async def model(model_choice: str) -> AsyncIterator[tuple[Server, str]]:
    """The model behind two servers on one engine: cumulative and incremental streaming."""
    async with two_stream_modes(dataclasses.replace(MODEL, model_path=model_choice)) as servers:
        yield servers


@pytest.mark.model
async def test_cached_tokens_in_every_shape(model: tuple[Server, str], model_choice: str) -> None:
    server, incremental_url = model
    sequence, batched = EXPECTED[model_choice]
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        assert (await client.post("/flush_cache")).status_code == 200
        # SGLang sends 100, 10000, 10000, 1000, 11000 tokens and reads 0, 100, 9999, 999,
        # 10000. Here a prompt seen before is restored whole (its last logits too), and other
        # prefixes are cut at chunk boundaries (multiples of 256): 100 is none; 1000 gets 768
        # of the 2000; 2200 gets 1792.
        cached = []
        for n in (100, 2000, 2000, 1000, 2200):
            response = await client.post("/generate", json=body(n))
            assert response.status_code == 200, response.text
            cached.append(response.json()["meta_info"]["cached_tokens"])
        assert cached == sequence

        batch = await client.post(
            "/generate", json={**body(600), "input_ids": [ids(600), ids(700)]}
        )
        assert [item["meta_info"]["cached_tokens"] for item in batch.json()] == batched

        stream = await client.post("/generate", json=body(600, stream=True))  # seen: whole
        frames = parse_sse(stream.text)[:-1]
        assert [f["meta_info"]["cached_tokens"] for f in frames] == [600] * len(frames)

        # n = 2: each choice restores the whole prompt; usage counts the prompt's cached
        # tokens once, as the first choice's (SGLang's count).
        completion = await client.post(
            "/v1/completions",
            json={"prompt": ids(600), "max_tokens": 4, "temperature": 0, "n": 2},
        )
        usage = completion.json()["usage"]
        assert usage["prompt_tokens"] == 600
        assert usage["prompt_tokens_details"] == {"cached_tokens": 600}

    async with httpx.AsyncClient(base_url=incremental_url, timeout=300) as client:
        stream = await client.post("/generate", json=body(700, stream=True))
    frames = parse_sse(stream.text)[:-1]
    assert frames and all(f["meta_info"]["cached_tokens"] == 700 for f in frames)


async def test_flush_cache_refuses_while_requests_run() -> None:
    async with running_server(sim_config()) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            prompt = {"text": "x" * 600, "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
            await client.post("/generate", json=prompt)
            assert server.eng.stats().prefix_cache_entries == 1
            long = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 3000}}
            async with client.stream("POST", "/generate", json=long) as running:
                async for line in running.aiter_lines():
                    if line.startswith("data: "):
                        break
                refused = await client.post("/flush_cache")
            assert (refused.status_code, refused.text) == (400, FLUSH_CACHE_MESSAGE)
            assert server.eng.stats().prefix_cache_entries == 2  # (its prompt, saved too)
            await wait_until(lambda: not server.eng.stats().running)  # reaped at a boundary
            flushed = await client.post("/flush_cache")
            assert (flushed.status_code, flushed.text) == (200, FLUSH_CACHE_MESSAGE)
            assert server.eng.stats().prefix_cache_entries == 0
            again = await client.post("/generate", json=prompt)
            assert again.json()["meta_info"]["cached_tokens"] == 0
