"""Requests the server refuses at once, with the status a client sees (sim runner): a batch
larger than the server ever holds, and new generations while draining."""

from __future__ import annotations

import httpx
import trio
from apphelpers import greedy, running_server, sim_config

from tributary import app


async def test_a_request_that_can_never_be_queued_is_a_400_not_a_retry_forever() -> None:
    async with running_server(sim_config(max_running_requests=2, max_queued_requests=6)) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            started = trio.current_time()
            for path, body in (
                ("/generate", {"text": "hi", "sampling_params": {"n": 2_000_000}}),
                ("/generate", {"input_ids": [[70]] * 9, "sampling_params": greedy(1)}),
                ("/v1/completions", {"prompt": "hi", "n": 2_000_000, "max_tokens": 1}),
            ):
                response = await client.post(path, json=body)
                assert response.status_code == 400, response.text
                assert "more than this server takes at once (8" in response.text
            assert trio.current_time() - started < 2.0  # no expansion of two million items
            ok = await client.post("/generate", json={"input_ids": [[70]] * 8})
            assert ok.status_code == 200 and len(ok.json()) == 8


async def test_new_generations_are_refused_once_draining() -> None:
    async with running_server() as server:
        quart_app = app.create_app(server.eng)
        app.server_state(quart_app).draining = True
        client = quart_app.test_client()
        for path, body in (
            ("/generate", {"text": "hi"}),
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/embeddings", {"input": "hi"}),
            ("/encode", {"text": "hi"}),
        ):
            response = await client.post(path, json=body)
            assert response.status_code == 503, path
            assert "shutting down" in (await response.get_data(as_text=True))
        assert server.eng.stats().running == 0 and server.eng.stats().waiting == 0
