"""`GET /metrics` as a dashboard reads it: scraped before and after a known workload on the sim
runner under `autojump_clock`, every count, sum and gauge moves by exactly what that workload
must produce, and agrees with what the responses themselves said (`e2e_latency`,
`completion_tokens`, `prompt_tokens`)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import trio
from apphelpers import greedy, parse_sse, wait_until
from prometheus_client.parser import text_string_to_metric_families

from tributary import app, engine
from tributary.testing import DEFAULT_SIM_LATENCY, AppClient, step_time, wait_engine_idle

#: No prefix cache: a prompt asked again would be restored whole, and these timings are of
#: prefills (tests/engine/test_prefix_cache.py times the hits).
pytestmark = pytest.mark.tributary_config(
    sim_latency=DEFAULT_SIM_LATENCY, max_running_requests=2, max_queued_requests=0,
    prefix_cache_mb=0,
)  # fmt: skip

#: One decode step of one sequence, and "hello" (5 prompt tokens) alone for 3 tokens.
DECODE = step_time(decoding=1)
HELLO_TTFT = step_time(prefill=5)
HELLO_3 = HELLO_TTFT + 2 * DECODE

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    """(sample name, labels other than model_name) -> value; checks every series carries
    the served model's name."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == "sim", sample
            samples[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return samples


async def scrape(client: AppClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    return parse_metrics(response.text)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_a_workload_moves_every_metric_by_what_the_responses_said(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock, incremental: bool
) -> None:
    eng = tributary_engine
    settings = app.ServerSettings(incremental_streaming_output=incremental)
    client = AppClient(app.create_app(eng, settings))
    before = await scrape(client)
    answers: list[dict[str, Any]] = []  # the meta_info of every answer a client received

    unary = await client.post("/generate", {"text": "hello", "sampling_params": greedy(3)})
    answers.append(unary.json()["meta_info"])
    batch = await client.post(
        "/generate", {"text": ["hello", "hi"], "sampling_params": [greedy(3), greedy(1)]}
    )
    answers += [item["meta_info"] for item in batch.json()]
    stream = await client.post(
        "/generate", {"text": "hello", "stream": True, "sampling_params": greedy(3)}
    )
    events = parse_sse(stream.text)
    assert events[-1] == "[DONE]" and len(events) == 4
    answers.append(events[-2]["meta_info"])

    # Two long generations hold both running slots; they send nothing (stream_interval)
    # until the client leaves, so they add no output to what the workload observed.
    held = {"text": ["hello", "hello"], "stream": True, "sampling_params": greedy(1000)}
    held["sampling_params"]["stream_interval"] = 1000
    async with client.stream("POST", "/generate", json=held) as holder:
        await wait_until(lambda: eng.stats().running == 2)
        steps = eng.stats().steps
        await wait_until(lambda: eng.stats().steps == steps + 1)
        during = await scrape(client)
        t_during, generated_during = trio.current_time(), eng.stats().generated_tokens
        # A full queue: a unary request gets 503; a stream gets SGLang's 200 abort frame.
        refused = await client.post("/generate", {"text": "hi", "sampling_params": greedy(1)})
        assert refused.status == 503
        refused_stream = await client.post(
            "/generate", {"text": "hi", "stream": True, "sampling_params": greedy(1)}
        )
        frame = parse_sse(refused_stream.text)[0]
        assert frame["meta_info"]["finish_reason"]["status_code"] == 503
        answers.append(frame["meta_info"])
        await holder.disconnect()
    await wait_engine_idle(eng, timeout=step_time(decoding=2))  # the step in flight
    after = await scrape(client)
    t_after, generated_after = trio.current_time(), eng.stats().generated_tokens

    # The gauges, from the scheduler's live state: both slots held, 10 prompt cells in use.
    assert value(during, "sglang:num_running_reqs") == 2
    assert value(during, "sglang:num_queue_reqs") == 0
    assert value(during, "sglang:num_used_tokens") == 10
    assert value(during, "sglang:token_usage") == pytest.approx(10 / (2 * 4096))
    for gauge in ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "token_usage"):
        assert value(after, f"sglang:{gauge}") == 0, gauge
    assert value(after, "sglang:gen_throughput") == pytest.approx(
        (generated_after - generated_during) / (t_after - t_during)
    )

    # Five answers (unary, two batch items, a stream, a refused stream), as they said.
    e2e = [meta["e2e_latency"] for meta in answers]
    assert e2e == pytest.approx([HELLO_3, step_time(prefill=7) + 2 * DECODE,
                                 step_time(prefill=7), HELLO_3, 0.0], abs=1e-9)  # fmt: skip
    assert delta(after, before, "sglang:e2e_request_latency_seconds_count") == len(answers)
    assert delta(after, before, "sglang:e2e_request_latency_seconds_sum") == pytest.approx(
        sum(e2e), abs=1e-9
    )
    assert delta(after, before, "sglang:num_requests_total") == len(answers)
    generated = sum(meta["completion_tokens"] for meta in answers)
    assert generated == 10
    assert delta(after, before, "sglang:generation_tokens_total") == generated
    assert delta(after, before, "sglang:prompt_tokens_total") == sum(
        meta["prompt_tokens"] for meta in answers
    )
    assert delta(after, before, "sglang:cached_tokens_total") == 0
    # Aborted: the two held items (the client left) and the two refused requests.
    assert delta(after, before, "sglang:num_aborted_requests_total") == 4

    # Phases of the four answers that ran: all admitted at once, first tokens after one step.
    assert delta(after, before, "sglang:queue_time_seconds_count") == 4
    assert delta(after, before, "sglang:queue_time_seconds_sum") == 0
    assert delta(after, before, "sglang:time_to_first_token_seconds_count") == 4
    assert delta(after, before, "sglang:time_to_first_token_seconds_sum") == pytest.approx(
        2 * HELLO_TTFT + 2 * step_time(prefill=7), abs=1e-9
    )
    # Every token after a request's first is one inter-token observation of one decode step.
    assert delta(after, before, "sglang:inter_token_latency_seconds_count") == 6
    assert delta(after, before, "sglang:inter_token_latency_seconds_sum") == pytest.approx(
        6 * DECODE, abs=1e-9
    )
    le = {"le": "0.015"}  # DECODE = 12 ms: in the 15 ms bucket, not the 10 ms one
    assert delta(after, before, "sglang:inter_token_latency_seconds_bucket", **le) == 6
    assert delta(after, before, "sglang:inter_token_latency_seconds_bucket", le="0.01") == 0

    # HTTP exchanges by route and status (the scrape in progress is not counted yet).
    http = "sglang:http_responses_total"
    generate = {"endpoint": "/generate", "method": "POST"}
    assert delta(after, before, http, **generate, status_code="200") == 5
    assert delta(after, before, http, **generate, status_code="503") == 1
    assert delta(after, before, http, endpoint="/metrics", method="GET", status_code="200") == 2
    assert delta(after, before, "sglang:http_requests_total", **generate) == 6


async def test_v1_requests_are_counted_like_generate(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    client = AppClient(app.create_app(tributary_engine))
    before = await scrape(client)
    body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
    unary = await client.post("/v1/completions", body)
    assert unary.json()["usage"]["completion_tokens"] == 3
    stream = await client.post("/v1/completions", {**body, "stream": True})
    assert parse_sse(stream.text)[-1] == "[DONE]"
    after = await scrape(client)
    assert delta(after, before, "sglang:num_requests_total") == 2
    assert delta(after, before, "sglang:generation_tokens_total") == 6
    assert delta(after, before, "sglang:prompt_tokens_total") == 10
    assert delta(after, before, "sglang:e2e_request_latency_seconds_sum") == pytest.approx(
        2 * HELLO_3, abs=1e-9
    )
    assert delta(after, before, "sglang:inter_token_latency_seconds_count") == 4
    route = {"endpoint": "/v1/completions", "method": "POST", "status_code": "200"}
    assert delta(after, before, "sglang:http_responses_total", **route) == 2


async def test_routes_are_series_by_rule_not_by_path(tributary_client: AppClient) -> None:
    for model in ("a", "b", "c"):
        assert (await tributary_client.get(f"/v1/models/{model}")).status == 404
    assert (await tributary_client.get("/no/such/path")).status == 404
    samples = await scrape(tributary_client)
    statuses = Counter(
        dict(labels)["endpoint"]
        for (name, labels), v in samples.items()
        if name == "sglang:http_responses_total"
        for _ in range(int(v))
    )
    assert statuses == {"/v1/models/<path:model_id>": 3, "unmatched": 1}


async def test_each_app_has_its_own_registry(tributary_engine: engine.Engine) -> None:
    first, second = (AppClient(app.create_app(tributary_engine)) for _ in range(2))
    await first.post("/generate", {"text": "hi", "sampling_params": greedy(2)})
    assert value(await scrape(first), "sglang:num_requests_total") == 1
    assert value(await scrape(second), "sglang:num_requests_total") == 0


async def test_disable_metrics_serves_no_metrics(tributary_engine: engine.Engine) -> None:
    settings = app.ServerSettings(enable_metrics=False)
    client = AppClient(app.create_app(tributary_engine, settings))
    reply = await client.post("/generate", {"text": "hi", "sampling_params": greedy(2)})
    assert reply.status == 200
    response = await client.get("/metrics")
    assert response.status == 404
    assert response.json() == {"error": {"message": response.json()["error"]["message"],
                                         "code": 404}}  # fmt: skip


async def test_metrics_need_the_api_key_and_health_does_not(
    tributary_engine: engine.Engine,
) -> None:
    client = AppClient(app.create_app(tributary_engine, app.ServerSettings(api_key="sekrit")))
    assert (await client.get("/metrics")).status == 401
    assert (await client.get("/health")).status == 200
    keyed = await client.get("/metrics", headers={"Authorization": "Bearer sekrit"})
    assert keyed.status == 200
    samples = parse_metrics(keyed.text)
    # The refused scrape was counted, under its route, as a 401.
    route = {"endpoint": "/metrics", "method": "GET", "status_code": "401"}
    assert value(samples, "sglang:http_responses_total", **route) == 1


def test_bucket_bounds_are_sglangs_with_finer_ones_below() -> None:
    from tributary.app.observe import metrics

    sglang_e2e = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400,
                  600, 1200, 1800, 2400]  # fmt: skip
    assert set(sglang_e2e) <= set(metrics.E2E_BUCKETS)
    assert metrics.E2E_BUCKETS[0] == 0.001 and metrics.E2E_BUCKETS == sorted(metrics.E2E_BUCKETS)
    assert metrics.QUEUE_BUCKETS[0] == 0.0 and metrics.QUEUE_BUCKETS[-1] == 3000
    assert json.dumps(metrics.ITL_BUCKETS)  # plain numbers
