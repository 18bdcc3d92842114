"""/metrics and the access log agree with what clients were told: failed, refused, probing and
departed requests are counted as the client saw them (each test states what a user or an
operator would notice)."""

from __future__ import annotations

import logging

import pytest
import trio
from apphelpers import greedy, parse_sse, wait_until
from test_metrics import delta, scrape

from tributary import app, engine
from tributary.testing import DEFAULT_SIM_LATENCY, AppClient

pytestmark = pytest.mark.tributary_config(sim_latency=DEFAULT_SIM_LATENCY)


async def test_v1_choices_of_a_failed_response_are_not_counted_as_answers(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    """Two prompts: "hi" stops on its 2nd token, "hello" runs past the deadline. The client
    gets a 408 and no usage at all, so generation_tokens_total must not move."""
    client = AppClient(app.create_app(tributary_engine))
    before = await scrape(client)
    body = {"prompt": ["hi", "hello"], "max_tokens": 4000, "temperature": 0,
            "stop_token_ids": [104]}  # fmt: skip
    reply = await client.post("/v1/completions", body, headers={"X-Request-Timeout": "0.2"})
    assert reply.status == 408
    streamed = await client.post(
        "/v1/completions", {**body, "stream": True}, headers={"X-Request-Timeout": "0.2"}
    )
    assert parse_sse(streamed.text)[-2]["error"]["message"] == "Request timed out after 0.2 s."
    after = await scrape(client)
    assert delta(after, before, "sglang:num_requests_total") == 0
    assert delta(after, before, "sglang:generation_tokens_total") == 0
    # The same two prompts without a deadline: both answered, both counted.
    ok = await client.post("/v1/completions", {**body, "max_tokens": 40, "stream": True})
    usage = parse_sse(ok.text)
    assert usage[-1] == "[DONE]"
    final = await scrape(client)
    assert delta(final, after, "sglang:num_requests_total") == 2


@pytest.mark.tributary_config(max_running_requests=1)
async def test_a_health_probe_is_not_counted_as_an_aborted_request(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    """docs/operations.md: "/health_generate's probe is not a client request and is not
    counted". On a busy server the probe passes on others' progress and is then aborted."""
    client = AppClient(app.create_app(tributary_engine))
    body = {"text": "hello", "stream": True, "sampling_params": greedy(4000)}
    async with client.stream("POST", "/generate", json=body) as busy:
        await busy.next_event()
        before = await scrape(client)
        for _ in range(3):
            assert (await client.get("/health_generate")).status == 200
        await trio.sleep(0.1)  # the probes' aborts are reaped at the next step boundaries
        after = await scrape(client)
    assert delta(after, before, "sglang:num_aborted_requests_total") == 0


@pytest.mark.tributary_config(max_running_requests=2, max_queued_requests=0)
async def test_a_refused_streamed_batch_counts_each_refused_item_as_aborted(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    """The client reads two abort frames (one per item); num_requests_total counts two; the
    aborted counter should count two as well."""
    client = AppClient(app.create_app(tributary_engine))
    hold = {"text": ["hello", "hey"], "stream": True, "sampling_params": greedy(4000)}
    async with client.stream("POST", "/generate", json=hold) as holder:
        await holder.next_event()
        await wait_until(lambda: tributary_engine.stats().running == 2)
        before = await scrape(client)
        body = {"text": ["a", "b"], "stream": True, "sampling_params": greedy(1)}
        frames = parse_sse((await client.post("/generate", body)).text)[:-1]
        assert [f["meta_info"]["finish_reason"]["status_code"] for f in frames] == [503, 503]
        after = await scrape(client)
        await holder.disconnect()
    assert delta(after, before, "sglang:num_requests_total") == 2
    assert delta(after, before, "sglang:num_aborted_requests_total") == 2


async def test_the_access_log_of_a_client_that_left_counts_the_tokens_it_got(
    tributary_client: AppClient,
    caplog: pytest.LogCaptureFixture,
    autojump_clock: trio.abc.Clock,
) -> None:
    caplog.set_level(logging.INFO, logger="tributary.access")
    body = {"text": "hello", "rid": "gone", "stream": True, "sampling_params": greedy(1000)}
    received = 0
    async with tributary_client.stream("POST", "/generate", json=body) as conn:
        for _ in range(5):
            event = await conn.next_event()
            received = event["meta_info"]["completion_tokens"]
        await conn.disconnect()
    [record] = [r for r in caplog.records if r.name == "tributary.access"]
    fields = record.__dict__["access"]
    assert fields["disconnected"] is True
    assert received == 5
    assert fields["completion_tokens"] >= received


async def test_a_client_chosen_rid_cannot_forge_an_access_log_line(
    tributary_client: AppClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tributary.access")
    rid = "x\ntributary.access:\trid=admin\tstatus=200"
    body = {"text": "hi", "rid": rid, "sampling_params": greedy(2)}
    assert (await tributary_client.post("/generate", body)).status == 200
    [record] = [r for r in caplog.records if r.name == "tributary.access"]
    message = record.getMessage()
    assert "\n" not in message and "\t" not in message
    assert message.startswith('rid="x\\ntributary.access:\\trid=admin\\tstatus=200" ')


@pytest.mark.tributary_config(max_running_requests=1, max_queued_requests=0)
async def test_a_refused_stream_frame_carries_the_timing_keys_too(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    """--enable-request-timing: every answer's terminal meta_info has the six keys (null
    where a phase did not happen), also SGLang's 200 abort frame of a full queue."""
    settings = app.ServerSettings(enable_request_timing=True)
    client = AppClient(app.create_app(tributary_engine, settings))
    hold = {"text": "hello", "stream": True, "sampling_params": greedy(4000)}
    async with client.stream("POST", "/generate", json=hold) as holder:
        await holder.next_event()
        body = {"text": "hi", "stream": True, "sampling_params": greedy(1)}
        [frame, done] = parse_sse((await client.post("/generate", body)).text)
        await holder.disconnect()
    meta = frame["meta_info"]
    assert meta["finish_reason"]["status_code"] == 503 and done == "[DONE]"
    assert list(meta)[-7:] == ["e2e_latency", "time_to_first_token", "queue_time",
                               "prefill_time", "decode_time", "mean_inter_token_latency",
                               "decode_throughput"]  # fmt: skip
    assert [meta[k] for k in list(meta)[-6:]] == [None] * 6
