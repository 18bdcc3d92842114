"""`/generate` with the real models over a real socket (SmolLM2, and Gemma 3 under
`-m second_model`): what the sim runner cannot show (real tokenization and decode cost, EOS,
llama.cpp steps in a worker thread)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from apphelpers import META_KEYS, Server, parse_sse, two_stream_modes, wait_until

from tributary.engine import EngineConfig

pytestmark = pytest.mark.model

#: Small context so the model loads fast; one thread because llama.cpp's threads spin-wait on
#: each other when another process holds one of the two cores.
MODEL = EngineConfig(context_length=2048, max_running_requests=8, threads=1)


#: A word each model's greedy continuation of "The capital of France is" has (Gemma 3 270M,
#: a base model: " the capital of the country of France.").
ANSWERS = {"smollm2-135m": "Paris", "gemma3-270m": "France"}

#: A request that ends with an end-of-generation token, per model. SmolLM2 answers its chat
#: turn and ends it; Gemma 3 270M is a base model that rarely ends a turn by itself, so its
#: end-of-turn token (106, not its EOS, 1) is made likely.
EOS_REQUESTS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"text": "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"},
    "gemma3-270m": {
        "text": "<start_of_turn>user\nSay yes.<end_of_turn>\n<start_of_turn>model\nYes.",
        "logit_bias": {"106": 30.0},
    },
}


@pytest.fixture
async def model(model_choice: str) -> AsyncIterator[tuple[Server, str]]:
    """The model behind two servers on one engine: cumulative and incremental streaming."""
    async with two_stream_modes(dataclasses.replace(MODEL, model_path=model_choice)) as servers:
        yield servers


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


async def timed(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    start = trio.current_time()
    response = await client.post("/generate", json=body)
    return response, trio.current_time() - start


def check_terminal(obj: dict[str, Any], elapsed: float) -> None:
    meta = obj["meta_info"]
    assert list(meta) == [*META_KEYS, "e2e_latency"]
    assert 0 < meta["e2e_latency"] <= elapsed
    assert meta["completion_tokens"] == len(obj["output_ids"])


async def test_latency_in_all_four_shapes(model: tuple[Server, str], model_choice: str) -> None:
    server, incremental_url = model
    body = {"text": "The capital of France is", "sampling_params": greedy(8)}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        unary, elapsed = await timed(client, body)
        assert unary.status_code == 200
        check_terminal(unary.json(), elapsed)
        assert ANSWERS[model_choice] in unary.json()["text"]
        assert unary.json()["meta_info"]["prompt_tokens"] == len(server.eng.tokenize(body["text"]))

        batch, elapsed = await timed(client, {**body, "text": [body["text"], "1, 2, 3,"]})
        for item in batch.json():
            check_terminal(item, elapsed)

        cumulative, elapsed = await timed(client, {**body, "stream": True})
        frames = parse_sse(cumulative.text)[:-1]
        check_terminal(frames[-1], elapsed)
        assert frames[-1]["text"] == unary.json()["text"]  # greedy: the same answer
        assert all("e2e_latency" not in f["meta_info"] for f in frames[:-1])

    async with httpx.AsyncClient(base_url=incremental_url, timeout=60) as client:
        incremental, elapsed = await timed(client, {**body, "stream": True})
    frames = parse_sse(incremental.text)[:-1]
    assert "".join(f["text"] for f in frames) == unary.json()["text"]
    assert all("e2e_latency" not in f["meta_info"] for f in frames[:-1])
    meta = frames[-1]["meta_info"]
    assert 0 < meta["e2e_latency"] <= elapsed
    assert meta["completion_tokens"] == len(unary.json()["output_ids"])


async def test_64_token_and_2_token_batch_items(model: tuple[Server, str]) -> None:
    server, _ = model
    body = {
        "text": ["Write a long story about a dragon.", "Hi"],
        "sampling_params": [greedy(64, ignore_eos=True), greedy(2, ignore_eos=True)],
    }
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        response, elapsed = await timed(client, body)
    long, short = response.json()
    assert long["meta_info"]["completion_tokens"] == 64
    assert short["meta_info"]["completion_tokens"] == 2
    check_terminal(long, elapsed)
    check_terminal(short, elapsed)
    # Drained concurrently, the short item reports its own end (2 of 64 decode steps after a
    # shared prefill), not the batch's.
    assert short["meta_info"]["e2e_latency"] < 0.5 * long["meta_info"]["e2e_latency"]


async def test_stream_disconnect_frees_the_sequence(model: tuple[Server, str]) -> None:
    server, _ = model
    eng = server.eng
    body = {"text": "Count to a thousand:", "stream": True, "sampling_params": greedy(1000)}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        async with client.stream("POST", "/generate", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
            assert eng.stats().running == 1
            steps_at_close = eng.stats().steps
    await wait_until(lambda: eng.stats().running == 0, timeout=30)
    assert eng.stats().steps - steps_at_close <= 2
    assert eng.stats().kv_used_cells == 0


async def test_eos_stops_with_the_stop_finish_reason(
    model: tuple[Server, str], model_choice: str
) -> None:
    server, _ = model
    request = dict(EOS_REQUESTS[model_choice])
    body = {"text": request.pop("text"), "sampling_params": greedy(200, **request)}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        response = await client.post("/generate", json=body)
    meta = response.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "stop"
    assert meta["finish_reason"]["matched"] in server.eng.model_info.eos_token_ids
    assert meta["completion_tokens"] < 200
