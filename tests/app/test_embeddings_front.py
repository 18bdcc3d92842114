"""Embeddings at a front (`--worker-url`): `/v1/embeddings` is relayed whole to a worker and its
answer comes back as it is; `/encode` is a 501 naming where to ask. The worker here runs the
sim runner, whose (fake) vectors are enough to see the relay carry them."""

from __future__ import annotations

import httpx

from tributary import app, testing
from tributary.engine import EngineConfig, open_engine
from tributary.engine.remote import RemoteConfig, open_remote_engine


async def test_a_front_relays_v1_embeddings_and_refuses_encode() -> None:
    body = {"input": ["hello", "world"], "encoding_format": "base64"}
    async with open_engine(EngineConfig(runner="sim")) as engine:
        async with app.open_http_server(engine, testing.server_settings()) as worker_urls:
            config = RemoteConfig(workers=((worker_urls[0], "sglang"),), health_check_interval=0)
            async with open_remote_engine(config) as front:
                async with app.open_http_server(front, testing.server_settings()) as urls:
                    async with httpx.AsyncClient(timeout=30) as client:
                        direct = await client.post(f"{worker_urls[0]}/v1/embeddings", json=body)
                        relayed = await client.post(f"{urls[0]}/v1/embeddings", json=body)
                        encode = await client.post(f"{urls[0]}/encode", json={"text": "hi"})
                        bad = await client.post(f"{urls[0]}/v1/embeddings", json={"input": []})
    assert relayed.status_code == direct.status_code == 200
    assert relayed.json()["data"] == direct.json()["data"]
    assert encode.status_code == 501
    assert "relays /v1/embeddings to them; call /encode on a worker" in encode.text
    # The worker's 400 comes back as it is.
    assert bad.status_code == 400 and "input is an empty list" in bad.text
