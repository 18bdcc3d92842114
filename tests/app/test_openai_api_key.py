"""With an API key configured, `/v1` answers 401 in OpenAI's shape unless the request carries
`Authorization: Bearer <key>` (sim runner: no model needed)."""

from __future__ import annotations

import dataclasses

import openai
import pytest
from apphelpers import running_server, sim_config

import app


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyedSettings(app.ServerSettings):
    # `ServerSettings` has no api_key field yet; the blueprint reads one when present.
    api_key: str | None = None


async def test_api_key_is_required_on_v1() -> None:
    settings = KeyedSettings(port=0, graceful_timeout=1.0, api_key="sekrit")
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
