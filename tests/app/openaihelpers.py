"""Helpers for the `/v1` tests (the fixtures are in openaifixtures.py).

Test modules import these with `from openaihelpers import ...` (tests/app/conftest.py puts
this directory on sys.path)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
from apphelpers import Server

from tributary.engine import EngineConfig

#: The real model, small enough to load in about 0.3 s per test. One thread: on a shared
#: 2-core machine, llama.cpp's two threads spin-wait on each other whenever another process
#: holds a core, and a step can take seconds. No prefix cache: these tests ask the same
#: prompt twice (unary and streamed, chat and completion) and compare the usage, whose
#: `cached_tokens` would then count the second one's whole-prompt hit (test_cached_tokens.py
#: covers that).
MODEL_CONFIG = EngineConfig(
    context_length=2048, max_running_requests=8, threads=1, prefix_cache_mb=0
)


def sync_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def model_name(server: Server) -> str:
    return server.eng.config.served_model_name or server.eng.model_info.name


def chat_body(server: Server, content: str = "What is 2+2?", **extra: Any) -> dict[str, Any]:
    """A greedy chat request body, for raw HTTP tests."""
    return {
        "model": model_name(server),
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 16,
        **extra,
    }


async def chat_prompt_is(
    http: httpx.AsyncClient, server: Server, messages: list[dict[str, str]], prompt_ids: list[int]
) -> str:
    """Check that `/v1/chat/completions` prompts the model with exactly `prompt_ids`: the same
    usage, and the same greedy answer, as `/v1/completions` given those ids. The answer."""
    greedy = {"max_tokens": 12, "temperature": 0}
    chat = await http.post(
        "/v1/chat/completions", json={"model": model_name(server), "messages": messages, **greedy}
    )
    completion = await http.post("/v1/completions", json={"prompt": prompt_ids, **greedy})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(prompt_ids)
    answer = chat.json()["choices"][0]["message"]["content"]
    assert answer == completion.json()["choices"][0]["text"]
    assert chat.json()["usage"] == completion.json()["usage"]
    return str(answer)
