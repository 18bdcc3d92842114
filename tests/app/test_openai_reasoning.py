"""`--reasoning-parser` end to end: thinking in `reasoning_content`, unary and streamed, with the
official client, the real model and a real socket; `separate_reasoning`,
`chat_template_kwargs.enable_thinking` and `reasoning_effort` as SGLang takes them.

SmolLM2 does not think, so the request's `regex` makes it write a DeepSeek-R1 answer (the
template of such a model opens `<think>`, so the output starts inside the thinking)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from apphelpers import Server
from openaihelpers import model_name
from test_openai_tools_auto import served_with

pytestmark = pytest.mark.model

THOUGHT, ANSWER = "Two and two make four.", "It is 4."
FORCE = "Two and two make four\\.</think>It is 4\\."


@pytest.fixture
async def r1() -> AsyncIterator[tuple[Server, openai.AsyncOpenAI]]:
    async with served_with(reasoning_parser="deepseek-r1") as served:
        yield served


def request(server: Server, **extra_body: Any) -> dict[str, Any]:
    return {
        "model": model_name(server),
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "temperature": 0,
        "max_tokens": 40,
        "extra_body": {"regex": FORCE, **extra_body},
    }


async def test_reasoning_content_unary_and_streamed(
    r1: tuple[Server, openai.AsyncOpenAI],
) -> None:
    server, client = r1
    reply = await client.chat.completions.create(**request(server))
    message = reply.choices[0].message
    assert message.reasoning_content == THOUGHT  # type: ignore[attr-defined]
    assert message.content == ANSWER
    assert reply.choices[0].finish_reason == "stop"

    stream = await client.chat.completions.create(**request(server), stream=True)
    reasoning, content = "", ""
    async for chunk in stream:
        delta = chunk.choices[0].delta
        piece = getattr(delta, "reasoning_content", None)
        assert not (piece and delta.content), "a delta is either reasoning or content"
        if piece and content:
            pytest.fail("reasoning after content")
        reasoning += piece or ""
        content += delta.content or ""
    assert (reasoning, content) == (THOUGHT, ANSWER)  # no marker leaks into either


async def test_reasoning_can_be_kept_in_the_content_or_turned_off(
    r1: tuple[Server, openai.AsyncOpenAI],
) -> None:
    server, client = r1
    whole = THOUGHT + "</think>" + ANSWER
    for extra in (
        {"separate_reasoning": False},
        # Thinking off: the template opened no <think>, so the output is not read as one.
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "none"},
    ):
        reply = await client.chat.completions.create(**request(server, **extra))
        message = reply.choices[0].message
        assert message.content == whole, extra
        assert getattr(message, "reasoning_content", None) is None, extra
