"""Defects a review found, each pinned by the behaviour a client sees (sim runner)."""

from __future__ import annotations

import time

import httpx
import trio
from apphelpers import greedy, running_server, server_settings, sim_config

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


async def test_openai_created_is_the_completion_time() -> None:
    async with running_server() as server:
        await trio.sleep(1.1)
        async with httpx.AsyncClient(base_url=server.url) as client:
            body = {"prompt": "hi", "max_tokens": 1}
            before = int(time.time())
            created = (await client.post("/v1/completions", json=body)).json()["created"]
            assert created >= before


async def test_api_key_bearer_scheme_and_shapes() -> None:
    settings = server_settings(api_key="sekrit")
    async with running_server(sim_config(), settings) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            body = {"text": "hi", "sampling_params": greedy(1)}
            for header, status in (
                ("Bearer sekrit", 200),
                ("bearer sekrit", 200),  # the scheme is case-insensitive
                ("sekrit", 401),  # but it is required
                ("Basic sekrit", 401),
            ):
                response = await client.post(
                    "/generate", json=body, headers={"Authorization": header}
                )
                assert response.status_code == status, header
            for method, path in (("GET", "/v1/completions"), ("POST", "/v1/nothing")):
                response = await client.request(method, path)
                assert response.status_code == 401
                assert response.json()["error"]["type"] == "authentication_error"
            info = await client.get("/get_server_info", headers={"Authorization": "Bearer sekrit"})
            assert info.json()["api_key"] == "***"
            assert "sekrit" not in info.text


async def test_new_generations_are_refused_once_draining() -> None:
    async with running_server() as server:
        quart_app = app.create_app(server.eng)
        app.server_state(quart_app).draining = True
        client = quart_app.test_client()
        for path, body in (
            ("/generate", {"text": "hi"}),
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            response = await client.post(path, json=body)
            assert response.status_code == 503, path
            assert "shutting down" in (await response.get_data(as_text=True))
        assert server.eng.stats().running == 0 and server.eng.stats().waiting == 0
