"""With an API key configured, requests need `Authorization: Bearer <key>`: `/v1` answers 401
in OpenAI's shape, `/generate` in SGLang's, and health probes stay open (sim runner)."""

from __future__ import annotations

import httpx
import openai
import pytest
from apphelpers import running_server, sim_config

from tributary import app


async def test_api_key_is_required_on_v1() -> None:
    settings = app.ServerSettings(port=0, graceful_timeout=1.0, api_key="sekrit")
    async with running_server(sim_config(), settings) as server:
        base_url = server.url + "/v1"
        async with openai.AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as info:
                await bad.models.list()
            assert info.value.status_code == 401
            assert info.value.code == "invalid_api_key"
            assert info.value.type == "authentication_error"
        async with openai.AsyncOpenAI(base_url=base_url, api_key="sekrit", max_retries=0) as good:
            page = await good.models.list()
            assert [m.id for m in page.data] == [server.eng.model_info.name]
            done = await good.completions.create(model=page.data[0].id, prompt="hi", max_tokens=2)
            assert done.usage is not None and done.usage.completion_tokens == 2


async def test_api_key_guards_generate_but_not_health() -> None:
    settings = app.ServerSettings(port=0, graceful_timeout=1.0, api_key="sekrit")
    async with running_server(sim_config(), settings) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
            denied = await client.post("/generate", json=body)
            assert denied.status_code == 401
            assert denied.json() == {
                "error": {"message": "Incorrect API key provided.", "code": 401}
            }
            headers = {"Authorization": "Bearer sekrit"}
            allowed = await client.post("/generate", json=body, headers=headers)
            assert allowed.status_code == 200
            assert allowed.json()["meta_info"]["completion_tokens"] == 2
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/get_model_info")).status_code == 401


async def test_unrouted_v1_paths_answer_in_openai_shape() -> None:
    async with running_server(sim_config(), app.ServerSettings(port=0)) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            missing = await client.get("/v1/nope")
            assert missing.status_code == 404
            assert missing.json()["error"]["type"] == "invalid_request_error"
            wrong_method = await client.get("/v1/completions")
            assert wrong_method.status_code == 405
            assert set(wrong_method.json()["error"]) == {"message", "type", "param", "code"}
