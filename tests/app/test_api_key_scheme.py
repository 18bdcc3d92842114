"""`--api-key`: the Bearer scheme as clients send it, and the 401 shapes of both APIs."""

from __future__ import annotations

import httpx
from apphelpers import greedy, running_server, server_settings, sim_config


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
