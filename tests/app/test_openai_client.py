"""The official `openai` package against `/v1` on a real Hypercorn socket and the real model:
sync and async clients, completions and chat, unary and streaming, n, stop, usage, models."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import trio
from apphelpers import Server
from openaihelpers import model_name, sync_client

pytest_plugins = ["openaifixtures"]  # model_server, http, aclient

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"
# Greedy answers of this small model can change with the batch it decodes in (llama.cpp's
# numerics depend on the batch), so exact-text comparisons are made between runs of the same
# shape, and content checks use an answer the model gives in every batch shape.
QUESTION = [{"role": "user", "content": "What is 2+2?"}]
GREEDY: dict[str, Any] = {"temperature": 0}
EXACT: dict[str, Any] = {"extra_body": {"ignore_eos": True}}


async def in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a blocking (sync client) call while the server keeps serving on this Trio loop."""
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


async def test_models_list_and_retrieve(model_server: Server) -> None:
    client = sync_client(model_server)
    name = model_name(model_server)
    page = await in_thread(client.models.list)
    assert [m.id for m in page.data] == [name]
    card = page.data[0]
    assert card.object == "model" and card.owned_by == "tributary"
    assert card.max_model_len == 2048  # type: ignore[attr-defined]
    assert card.root == name and card.parent is None  # type: ignore[attr-defined]
    assert (await in_thread(client.models.retrieve, name)).id == name
    with pytest.raises(openai.NotFoundError) as info:
        await in_thread(client.models.retrieve, "no-such-model")
    assert "no-such-model" in info.value.message
    assert info.value.code == "model_not_found"


async def test_sync_completion_unary_and_stream(model_server: Server) -> None:
    client = sync_client(model_server)
    name = model_name(model_server)
    unary = await in_thread(
        client.completions.create, model=name, prompt=PROMPT, max_tokens=5, **GREEDY, **EXACT
    )
    assert unary.object == "text_completion" and unary.model == name
    [choice] = unary.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.text.strip(), "the model produced text"
    usage = unary.usage
    assert usage.completion_tokens == 5
    assert usage.prompt_tokens == len(model_server.eng.tokenize(PROMPT))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0

    def stream_all() -> list[Any]:
        stream = client.completions.create(
            model=name,
            prompt=PROMPT,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
            **EXACT,
        )
        return list(stream)

    chunks = await in_thread(stream_all)
    *content, last = chunks
    assert last.choices == [] and last.usage == usage
    assert all(c.usage is None for c in content)
    assert "".join(c.choices[0].text for c in content) == choice.text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert len({c.id for c in chunks}) == 1


async def test_async_completion_prompt_list_n2_and_token_prompt(
    aclient: openai.AsyncOpenAI, model_server: Server
) -> None:
    name = model_name(model_server)
    other = "1, 2, 3,"
    result = await aclient.completions.create(
        model=name, prompt=[PROMPT, other], n=2, max_tokens=4, **GREEDY, **EXACT
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    texts = [c.text for c in result.choices]
    assert all("Paris" in t for t in texts[:2]) and all("4" in t for t in texts[2:]), texts
    single = await aclient.completions.create(model=name, prompt=other, max_tokens=4, **GREEDY)
    tokenize = model_server.eng.tokenize
    assert result.usage.prompt_tokens == len(tokenize(PROMPT)) + len(tokenize(other))
    assert result.usage.completion_tokens == 16

    by_ids = await aclient.completions.create(
        model=name, prompt=tokenize(other), max_tokens=4, **GREEDY
    )
    assert by_ids.choices[0].text == single.choices[0].text
    assert by_ids.usage.prompt_tokens == single.usage.prompt_tokens
    echoed = await aclient.completions.create(
        model=name, prompt=other, max_tokens=4, echo=True, **GREEDY
    )
    assert echoed.choices[0].text == other + single.choices[0].text

    stream = await aclient.completions.create(
        model=name, prompt=PROMPT, n=2, max_tokens=4, stream=True, **GREEDY, **EXACT
    )
    streamed = ["", ""]
    finished: list[str | None] = [None, None]
    async for chunk in stream:
        [c] = chunk.choices
        streamed[c.index] += c.text
        if c.finish_reason is not None:
            finished[c.index] = c.finish_reason
    assert all("Paris" in t for t in streamed), streamed
    assert finished == ["length", "length"]


async def test_completion_stop_string(aclient: openai.AsyncOpenAI, model_server: Server) -> None:
    name = model_name(model_server)
    free = await aclient.completions.create(model=name, prompt=PROMPT, max_tokens=12, **GREEDY)
    text = free.choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    stopped = await aclient.completions.create(
        model=name, prompt=PROMPT, max_tokens=12, stop=[stop], **GREEDY
    )
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.matched_stop == stop  # type: ignore[attr-defined]
    assert choice.text == text[: text.index(stop)]
    assert stopped.usage.completion_tokens < free.usage.completion_tokens


async def test_sync_chat_is_greedy_and_repeatable(model_server: Server) -> None:
    client = sync_client(model_server)
    name = model_name(model_server)
    first, second = [
        await in_thread(
            client.chat.completions.create, model=name, messages=QUESTION, max_tokens=24, **GREEDY
        )
        for _ in range(2)
    ]
    assert first.object == "chat.completion"
    message = first.choices[0].message
    assert message.role == "assistant"
    assert "4" in message.content
    assert message.content == second.choices[0].message.content
    assert first.choices[0].finish_reason in ("stop", "length")
    parts = await in_thread(
        client.chat.completions.create,
        model=name,
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}],
        max_tokens=24,
        **GREEDY,
    )
    assert parts.choices[0].message.content == message.content
    assert parts.usage == first.usage


async def test_async_chat_stream_matches_unary(
    aclient: openai.AsyncOpenAI, model_server: Server
) -> None:
    name = model_name(model_server)
    unary = await aclient.chat.completions.create(
        model=name, messages=QUESTION, max_completion_tokens=6, **GREEDY, **EXACT
    )
    assert unary.usage.completion_tokens == 6
    assert unary.choices[0].finish_reason == "length"
    stream = await aclient.chat.completions.create(
        model=name,
        messages=QUESTION,
        max_completion_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
        **EXACT,
    )
    chunks = [chunk async for chunk in stream]
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    first, *middle, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in middle)
    assert "".join(c.choices[0].delta.content for c in [first, *middle]) == (
        unary.choices[0].message.content
    )
    assert finish.choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in [first, *middle])
    assert usage.choices == [] and usage.usage == unary.usage


async def test_async_chat_n2_stop_and_stream(
    aclient: openai.AsyncOpenAI, model_server: Server
) -> None:
    name = model_name(model_server)
    both = await aclient.chat.completions.create(
        model=name, messages=QUESTION, n=2, max_tokens=12, **GREEDY
    )
    assert [c.index for c in both.choices] == [0, 1]
    assert all("4" in c.message.content for c in both.choices)
    single = await aclient.chat.completions.create(
        model=name, messages=QUESTION, max_tokens=12, **GREEDY
    )
    assert both.usage.prompt_tokens == single.usage.prompt_tokens  # counted once per prompt
    steps = model_server.eng.stats().steps
    exact = await aclient.chat.completions.create(
        model=name, messages=QUESTION, n=2, max_tokens=5, **GREEDY, **EXACT
    )
    assert exact.usage.completion_tokens == 10
    # Both choices were decoded together: 5 tokens each took about 5 steps, not 10.
    assert model_server.eng.stats().steps - steps <= 6
    assert exact.usage.total_tokens == single.usage.prompt_tokens + 10

    answer = single.choices[0].message.content
    stop = answer.split()[1]
    stopped = await aclient.chat.completions.create(
        model=name, messages=QUESTION, max_tokens=12, stop=stop, **GREEDY
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == answer[: answer.index(stop)]

    stream = await aclient.chat.completions.create(
        model=name, messages=QUESTION, n=2, max_tokens=12, stream=True, **GREEDY
    )
    texts = ["", ""]
    roles: list[list[str]] = [[], []]
    async for chunk in stream:
        [c] = chunk.choices
        if c.delta.role:
            roles[c.index].append(c.delta.role)
        texts[c.index] += c.delta.content or ""
    assert all("4" in t for t in texts), texts
    assert roles == [["assistant"], ["assistant"]]
