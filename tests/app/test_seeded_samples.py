"""Parallel samples with a seed (sim runner): reproducible as a whole, different from each other."""

from __future__ import annotations

import httpx
from apphelpers import running_server


async def test_seeded_parallel_samples_differ_and_repeat() -> None:
    async with running_server() as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            params = {"n": 3, "sampling_seed": 7, "temperature": 1.0, "max_new_tokens": 12}
            body = {"text": "hi", "sampling_params": params}
            first = [i["text"] for i in (await client.post("/generate", json=body)).json()]
            again = [i["text"] for i in (await client.post("/generate", json=body)).json()]
            assert first == again  # reproducible as a whole
            assert len(set(first)) == 3  # but three different draws
            v1 = {"prompt": "hi", "n": 2, "seed": 7, "temperature": 1.0, "max_tokens": 12}
            choices = (await client.post("/v1/completions", json=v1)).json()["choices"]
            assert choices[0]["text"] != choices[1]["text"]
