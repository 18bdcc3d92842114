"""Fixtures for the `/v1` tests, loaded with `pytest_plugins = ["openaifixtures"]` (tests/app's
conftest.py belongs to the /generate tests): the real model behind a real Hypercorn socket,
and clients for it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from apphelpers import Server, running_server
from openaihelpers import MODEL_CONFIG


@pytest.fixture
async def model_server() -> AsyncIterator[Server]:
    async with running_server(MODEL_CONFIG) as server:
        yield server


@pytest.fixture
async def http(model_server: Server) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=model_server.url, timeout=60) as client:
        yield client


@pytest.fixture
async def aclient(model_server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=model_server.url + "/v1", api_key="none", max_retries=0, timeout=60
    )
    async with client:
        yield client
