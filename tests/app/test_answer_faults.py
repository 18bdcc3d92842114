"""A unary answer is built in the engine's scheduler as each item arrives
(`engine.collect_redirected`); a bug while building it must still give the client a 500,
never a hang and never a 200 with tokens missing, and must abort what still runs."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from apphelpers import greedy
from test_metrics import delta, scrape

from tributary import app, engine, testing
from tributary.app.openai import choices, streaming
from tributary.app.sglang import output as app_output
from tributary.engine import Done, Frame
from tributary.testing import AppClient


def break_the_answer_on(kind: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make building a /generate answer raise when it adds an item of `kind`."""
    add = app_output.OutputAccumulator.add

    def failing_add(self: Any, item: Any) -> None:
        if isinstance(item, kind):
            raise RuntimeError("formatting bug")
        add(self, item)

    monkeypatch.setattr(app_output.OutputAccumulator, "add", failing_add)


@pytest.mark.parametrize("fails_on", [Frame, Done])
async def test_generate_whose_answer_fails_to_build_answers_500(
    tributary_client: testing.AppClient,
    tributary_engine: engine.Engine,
    monkeypatch: pytest.MonkeyPatch,
    autojump_clock: trio.abc.Clock,
    fails_on: type,
) -> None:
    break_the_answer_on(fails_on, monkeypatch)
    with trio.fail_after(60):
        response = await tributary_client.post(
            "/generate", json={"text": "hi", "sampling_params": greedy(40)}
        )
    assert response.status == 500
    await testing.wait_engine_idle(tributary_engine, timeout=1)  # the 40 tokens were aborted
    assert tributary_engine.stats().generated_tokens < 40 or fails_on is Done


async def test_a_v1_completion_whose_choice_fails_to_build_answers_500(
    tributary_client: testing.AppClient,
    tributary_engine: engine.Engine,
    monkeypatch: pytest.MonkeyPatch,
    autojump_clock: trio.abc.Clock,
) -> None:
    add = choices.Choice.add

    def failing_add(self: Any, item: Any) -> Any:
        if isinstance(item, Done):
            raise RuntimeError("bug")
        return add(self, item)

    monkeypatch.setattr(choices.Choice, "add", failing_add)
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0, "n": 2}
    with trio.fail_after(60):
        response = await tributary_client.post("/v1/completions", json=body)
    assert response.status == 500
    await testing.wait_engine_idle(tributary_engine, timeout=1)


@pytest.mark.parametrize("batch", [False, True])
async def test_a_generate_500_from_an_answer_that_failed_to_build_is_not_counted_as_answered(
    tributary_engine: engine.Engine,
    monkeypatch: pytest.MonkeyPatch,
    autojump_clock: trio.abc.Clock,
    batch: bool,
) -> None:
    client = AppClient(app.create_app(tributary_engine))
    break_the_answer_on(Done, monkeypatch)
    before = await scrape(client)
    text: Any = ["hi", "hello"] if batch else "hi"
    reply = await client.post("/generate", json={"text": text, "sampling_params": greedy(4)})
    assert reply.status == 500
    after = await scrape(client)
    assert delta(after, before, "sglang:num_requests_total") == 0
    assert delta(after, before, "sglang:generation_tokens_total") == 0


async def test_a_generate_answer_that_fails_to_render_after_its_last_item_is_not_counted(
    tributary_engine: engine.Engine,
    monkeypatch: pytest.MonkeyPatch,
    autojump_clock: trio.abc.Clock,
) -> None:
    """The engine's `Done` arrived (the request ended with an answer), then rendering the
    answer failed: the client gets a 500, and /metrics counts no answer (docs/operations.md:
    failures are not counted)."""
    client = AppClient(app.create_app(tributary_engine))

    def failing_cumulative(self: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("render bug")

    monkeypatch.setattr(app_output.OutputAccumulator, "cumulative", failing_cumulative)
    before = await scrape(client)
    reply = await client.post("/generate", json={"text": "hi", "sampling_params": greedy(3)})
    assert reply.status == 500
    after = await scrape(client)
    assert delta(after, before, "sglang:num_requests_total") == 0
    assert delta(after, before, "sglang:generation_tokens_total") == 0


async def test_a_v1_stream_that_fails_to_render_its_end_is_not_counted(
    tributary_engine: engine.Engine,
    monkeypatch: pytest.MonkeyPatch,
    autojump_clock: trio.abc.Clock,
) -> None:
    """Every choice finished, then the stream's end failed to render (its 200 already
    sent): the client never got the answer, and /metrics does not count it."""
    client = AppClient(app.create_app(tributary_engine))

    def failing_end(self: Any) -> Any:
        raise RuntimeError("render bug at the end")

    monkeypatch.setattr(streaming.ChunkStreamBody, "_end", failing_end)
    before = await scrape(client)
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    with pytest.raises(RuntimeError, match="render bug at the end"):
        await client.post("/v1/completions", json=body)
    after = await scrape(client)
    assert delta(after, before, "sglang:num_requests_total") == 0
    assert delta(after, before, "sglang:generation_tokens_total") == 0
