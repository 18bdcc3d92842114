"""A front serving /generate and /v1 from three Tributary workers (sim runner, loopback):
batches spread over the workers and come back in order, streams pass through unchanged in
both stream modes, n and rid fan-out, per-item e2e_latency and worker_e2e_latency."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families
from remotehelpers import generate, greedy, open_fleet, served_by, sse

from tributary import testing

PROMPTS = [f"prompt number {i} says" for i in range(12)]

#: meta_info keys that are times, so differ between two runs of the same request.
TIMES = {"e2e_latency", "response_sent_to_client_ts", "id"}


def untimed(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in obj["meta_info"].items() if k not in TIMES}
    return {**obj, "meta_info": meta}


async def test_a_batch_goes_to_one_worker_and_returns_in_order() -> None:
    """As SGLang's gateway sends a batch body to one worker whole: a batch whose items were
    spread over the workers could take one worker per item down."""
    async with open_fleet(3) as fleet, httpx.AsyncClient(timeout=30) as client:
        body = {"text": PROMPTS, "sampling_params": greedy(8), "rid": [f"r{i}" for i in range(12)]}
        front = await generate(client, fleet.url, body)
        assert front.status_code == 200, front.text
        answers = front.json()
        direct = (await generate(client, fleet.workers[0].url, body)).json()
        assert [a["meta_info"]["id"] for a in answers] == [f"r{i}" for i in range(12)]
        # Asked again, the worker that served the batch restores each prompt whole from its
        # prefix cache: the same answers, but for cached_tokens.
        assert [d["meta_info"].pop("cached_tokens") for d in direct] == [
            d["meta_info"]["prompt_tokens"] for d in direct
        ]
        assert [untimed(a) for a in answers] == [
            {**untimed(d), "meta_info": {**untimed(d)["meta_info"], "cached_tokens": 0}}
            for d in direct
        ]
        assert all(a["meta_info"]["e2e_latency"] > 0 for a in answers)
        # Round robin over three, and one worker served all the items.
        assert sum(1 for tokens in served_by(fleet) if tokens > 0) == 1
        stats = {w.url: w for w in fleet.front.worker_stats()}
        assert sum(s.requests_total for s in stats.values()) == 12
        assert all(s.in_flight == 0 and s.breaker == "closed" for s in stats.values())


async def _stream_events(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Any]:
    response = await generate(client, url, {**body, "stream": True})
    assert response.status_code == 200, response.text
    events = sse(response.text)
    assert events[-1] == "[DONE]"
    return events[:-1]


def _final_texts(events: list[Any], incremental: bool) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events:
        i = e.get("index", 0)
        texts[i] = texts.get(i, "") + e["text"] if incremental else e["text"]
    return texts


async def test_streams_pass_through_in_both_modes() -> None:
    body = {"text": PROMPTS[:3], "sampling_params": greedy(12)}
    for incremental in (False, True):
        # Workers stream cumulative text (SGLang's default) and the front incremental, and
        # the other way round: the front's parser is agnostic of the worker's mode.
        async with (
            open_fleet(
                3,
                worker_settings={"incremental_streaming_output": not incremental},
                front_settings={"incremental_streaming_output": incremental},
            ) as fleet,
            httpx.AsyncClient(timeout=30) as client,
        ):
            front = await _stream_events(client, fleet.url, body)
            w = fleet.workers[0]
            direct_app_settings = {"incremental_streaming_output": incremental}
            async with trio.open_nursery() as nursery:
                from remotehelpers import start_worker

                same_mode = await start_worker(nursery, w.engine, **direct_app_settings)
                direct = await _stream_events(client, same_mode.url, body)
                same_mode.kill()
            assert _final_texts(front, incremental) == _final_texts(direct, incremental)
            ends = {e["index"]: e for e in front if e["meta_info"]["finish_reason"]}
            direct_ends = {e["index"]: e for e in direct if e["meta_info"]["finish_reason"]}
            for i, end in ends.items():
                assert "e2e_latency" in end["meta_info"]
                mine, theirs = end["meta_info"], direct_ends[i]["meta_info"]
                for key in ("finish_reason", "prompt_tokens", "completion_tokens"):
                    assert mine[key] == theirs[key]
            if incremental:
                ids = {
                    i: [t for e in front if e["index"] == i for t in e["output_ids"]] for i in ends
                }
                direct_ids = {
                    i: [t for e in direct if e["index"] == i for t in e["output_ids"]] for i in ends
                }
                assert ids == direct_ids
            else:
                assert {i: e["output_ids"] for i, e in ends.items()} == {
                    i: e["output_ids"] for i, e in direct_ends.items()
                }


async def test_n_and_rid_fan_out() -> None:
    async with open_fleet(3) as fleet, httpx.AsyncClient(timeout=30) as client:
        body = {"text": "fan me out", "rid": "fan", "sampling_params": greedy(6, n=3)}
        answers = (await generate(client, fleet.url, body)).json()
        assert [a["meta_info"]["id"] for a in answers] != []
        assert len(answers) == 3
        assert len({a["text"] for a in answers}) == 1  # greedy: the same on every worker
        events = await _stream_events(client, fleet.url, body)
        assert {e["index"] for e in events} == {0, 1, 2}
        # An abort of the client's rid reaches its fanned-out items (rid_0, rid_1, ...).
        long = {"text": ["a", "b"], "rid": "family", "sampling_params": greedy(2000)}
        async with trio.open_nursery() as nursery:
            results: list[Any] = []

            async def run() -> None:
                results.append(await generate(client, fleet.url, long))

            nursery.start_soon(run)
            with trio.fail_after(5):
                while fleet.front.load().num_reqs < 2:
                    await trio.sleep(0.01)
            await client.post(f"{fleet.url}/abort_request", json={"rid": "family"})
        answers = results[0].json()
        assert [a["meta_info"]["finish_reason"]["type"] for a in answers] == ["abort", "abort"]
        with trio.fail_after(5):
            while any(w.engine.load().num_reqs for w in fleet.workers):
                await trio.sleep(0.01)


async def test_worker_e2e_latency_with_request_timing() -> None:
    async with (
        open_fleet(2, front_settings={"enable_request_timing": True}) as fleet,
        httpx.AsyncClient(timeout=30) as client,
    ):
        answer = (
            await generate(client, fleet.url, {"text": "hi", "sampling_params": greedy(4)})
        ).json()
        meta = answer["meta_info"]
        assert 0 < meta["worker_e2e_latency"] <= meta["e2e_latency"]
        # Time to first token is the front's own, as e2e_latency is (and /metrics has it).
        assert 0 < meta["time_to_first_token"] <= meta["e2e_latency"]
        assert meta["decode_time"] is not None and meta["queue_time"] is None
        metrics = (await client.get(f"{fleet.url}/metrics")).text
        ttft = [
            sample.value
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples
            if sample.name == "sglang:time_to_first_token_seconds_count"
        ]
        assert ttft == [1.0]
    async with open_fleet(1) as fleet, httpx.AsyncClient(timeout=30) as client:
        answer = (
            await generate(client, fleet.url, {"text": "hi", "sampling_params": greedy(4)})
        ).json()
        assert "worker_e2e_latency" not in answer["meta_info"]


async def test_what_the_front_cannot_do_is_a_clear_501() -> None:
    async with open_fleet(1) as fleet, httpx.AsyncClient(timeout=30) as client:
        tokenize = await client.post(f"{fleet.url}/tokenize", json={"prompt": "hi"})
        assert tokenize.status_code == 501
        assert "tokenizer" in tokenize.text
        logprobs = await generate(
            client, fleet.url, {"text": "hi", "return_logprob": True, "sampling_params": greedy(2)}
        )
        assert logprobs.status_code == 501
        flush = await client.post(f"{fleet.url}/flush_cache")
        assert flush.status_code == 501
        # What the front reports of the model is the worker's; its health probe goes through.
        info = (await client.get(f"{fleet.url}/get_model_info")).json()
        direct = (await client.get(f"{fleet.workers[0].url}/get_model_info")).json()
        for key in ("model_path", "served_model_name", "context_length", "vocab_size"):
            assert info[key] == direct[key]
        assert (await client.get(f"{fleet.url}/health_generate")).status_code == 200
        completion = await client.post(
            f"{fleet.url}/v1/completions",
            json={
                "model": fleet.front.model_info.name,
                "prompt": "hi",
                "max_tokens": 4,
                "temperature": 0,
            },
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] == 4


async def test_requests_through_a_front_leave_no_cycles() -> None:
    """A request the front forwarded is freed by reference counting, at the front as at
    the workers (tests/app/test_no_garbage_cycles.py), whether answered or streamed."""
    async with open_fleet(2) as fleet, httpx.AsyncClient(timeout=30) as client:
        body = {"text": PROMPTS[:3], "sampling_params": greedy(4)}
        with testing.garbage_cycles() as cycles:
            for _ in range(2):
                assert (await generate(client, fleet.url, body)).status_code == 200
                await _stream_events(client, fleet.url, body)
            with trio.fail_after(10):  # the forwarding tasks of the last requests are over
                while any(w.in_flight for w in fleet.front.worker_stats()):
                    await trio.sleep(0.01)
            assert cycles() == Counter()
