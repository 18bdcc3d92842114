"""`/generate` over a real Hypercorn socket (sim runner): shapes, latency, batches, streams,
and the applicable cases of the contract's section 9 checklist (numbers in the test names)."""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any

import httpx
import trio
from apphelpers import (
    META_KEYS,
    Server,
    greedy,
    parse_sse,
    running_server,
    server_settings,
    sim_config,
    wait_until,
)

from tributary.engine import GenerateRequest, SamplingParams


async def timed_post(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> tuple[httpx.Response, float]:
    start = trio.current_time()
    response = await client.post("/generate", json=body)
    return response, trio.current_time() - start


def assert_terminal(obj: dict[str, Any], client_elapsed: float) -> None:
    meta = obj["meta_info"]
    assert list(meta) == [*META_KEYS, "e2e_latency"]
    assert meta["finish_reason"] is not None
    assert isinstance(meta["e2e_latency"], float)
    assert 0 < meta["e2e_latency"] <= client_elapsed
    assert meta["completion_tokens"] == len(obj["output_ids"])


def assert_non_terminal(obj: dict[str, Any]) -> None:
    assert list(obj["meta_info"]) == META_KEYS
    assert obj["meta_info"]["finish_reason"] is None


async def test_01_29_unary_single(client: httpx.AsyncClient) -> None:
    body = {"text": "hello", "rid": "my-rid", "sampling_params": greedy(16)}
    response, elapsed = await timed_post(client, body)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    obj = response.json()
    assert list(obj) == ["text", "output_ids", "meta_info"]
    assert_terminal(obj, elapsed)
    meta = obj["meta_info"]
    assert meta["id"] == "my-rid"
    assert meta["finish_reason"] == {"type": "length", "length": 16}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 16
    assert meta["weight_version"] == "default"
    assert len(obj["text"]) == 16
    assert not {"ttft", "time_to_first_token"} & set(meta)


async def test_02_batch_of_one_is_a_list(client: httpx.AsyncClient) -> None:
    response, elapsed = await timed_post(client, {"text": ["hello"], "sampling_params": greedy(4)})
    assert response.status_code == 200
    items = response.json()
    assert isinstance(items, list) and len(items) == 1
    assert_terminal(items[0], elapsed)
    assert "index" not in items[0]


async def test_03_n_expands_prompt_major_with_fresh_rids(client: httpx.AsyncClient) -> None:
    body = {
        "text": ["a", "abc"],
        "rid": ["x", "y"],
        "sampling_params": {"max_new_tokens": 3, "n": 2},
    }
    response, elapsed = await timed_post(client, body)
    assert response.status_code == 200
    items = response.json()
    assert [i["meta_info"]["prompt_tokens"] for i in items] == [1, 1, 3, 3]
    rids = [i["meta_info"]["id"] for i in items]
    assert len(set(rids)) == 4 and not {"x", "y"} & set(rids)
    for item in items:
        assert_terminal(item, elapsed)


async def test_03_single_prompt_n3_streams_indices(client: httpx.AsyncClient) -> None:
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 4, "n": 3}}
    response = await client.post("/generate", json=body)
    assert response.status_code == 200
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    frames = events[:-1]
    assert {f["index"] for f in frames} == {0, 1, 2}
    finals = [f for f in frames if f["meta_info"]["finish_reason"] is not None]
    assert sorted(f["index"] for f in finals) == [0, 1, 2]


async def test_batch_items_each_carry_latency(client: httpx.AsyncClient) -> None:
    body = {"text": ["one", "two", "three"], "sampling_params": greedy(5)}
    response, elapsed = await timed_post(client, body)
    items = response.json()
    assert [i["meta_info"]["prompt_tokens"] for i in items] == [3, 3, 5]
    for item in items:
        assert_terminal(item, elapsed)


async def test_short_item_finishes_before_long_one_in_request_order(
    client: httpx.AsyncClient,
) -> None:
    body = {"text": ["long prompt", "short"], "sampling_params": [greedy(64), greedy(2)]}
    response, elapsed = await timed_post(client, body)
    long, short = response.json()
    assert long["meta_info"]["completion_tokens"] == 64
    assert short["meta_info"]["completion_tokens"] == 2
    assert_terminal(long, elapsed)
    assert_terminal(short, elapsed)
    # Drained concurrently: the short item's latency ends at its own Done (about 2 of the
    # 64 decode steps), not when the long item finishes.
    assert short["meta_info"]["e2e_latency"] < 0.25 * long["meta_info"]["e2e_latency"]


async def test_26_cumulative_stream(client: httpx.AsyncClient) -> None:
    body = {"text": "hello", "sampling_params": greedy(8)}
    unary = (await client.post("/generate", json=body)).json()
    start = trio.current_time()
    response = await client.post("/generate", json={**body, "stream": True})
    elapsed = trio.current_time() - start
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    frames = events[:-1]
    assert all("index" not in f for f in frames)
    for previous, frame in itertools.pairwise(frames):
        assert frame["text"].startswith(previous["text"])
        assert frame["output_ids"][: len(previous["output_ids"])] == previous["output_ids"]
    for frame in frames[:-1]:
        assert_non_terminal(frame)
    assert_terminal(frames[-1], elapsed)
    assert frames[-1]["text"] == unary["text"]
    assert frames[-1]["output_ids"] == unary["output_ids"]


async def test_25_incremental_stream() -> None:
    settings = server_settings(incremental_streaming_output=True)
    async with running_server(settings=settings) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            body = {"text": "hello", "sampling_params": greedy(8)}
            unary = (await client.post("/generate", json=body)).json()
            start = trio.current_time()
            response = await client.post("/generate", json={**body, "stream": True})
            elapsed = trio.current_time() - start
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    frames = events[:-1]
    assert len(frames) == 8  # stream_interval 1: one delta per token, none lost
    assert "".join(f["text"] for f in frames) == unary["text"]
    assert [i for f in frames for i in f["output_ids"]] == unary["output_ids"]
    assert [f["meta_info"]["completion_tokens"] for f in frames] == list(range(1, 9))
    for frame in frames[:-1]:
        assert_non_terminal(frame)
        assert len(frame["output_ids"]) == 1
    final = frames[-1]
    meta = final["meta_info"]
    assert list(meta) == [*META_KEYS, "e2e_latency"]
    assert 0 < meta["e2e_latency"] <= elapsed
    assert meta["completion_tokens"] == 8 and len(final["output_ids"]) == 1


async def test_22_batch_stream_interleaves_with_index(client: httpx.AsyncClient) -> None:
    body = {"text": ["aaaa", "b"], "stream": True, "sampling_params": [greedy(6), greedy(3)]}
    start = trio.current_time()
    response = await client.post("/generate", json=body)
    elapsed = trio.current_time() - start
    events = parse_sse(response.text)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    for index, length in [(0, 6), (1, 3)]:
        frames = [f for f in events[:-1] if f["index"] == index]
        assert list(frames[-1]) == ["text", "output_ids", "meta_info", "index"]
        for frame in frames[:-1]:
            assert_non_terminal(frame)
        assert_terminal(frames[-1], elapsed)
        assert frames[-1]["meta_info"]["completion_tokens"] == length
        texts = [f["text"] for f in frames]
        assert all(b.startswith(a) for a, b in itertools.pairwise(texts))


async def test_15_rid_reuse_sequential_ok_concurrent_rejected(
    sim_server: Server, client: httpx.AsyncClient
) -> None:
    body = {"text": "hello", "rid": "same", "sampling_params": greedy(2)}
    for _ in range(2):
        assert (await client.post("/generate", json=body)).status_code == 200
    long = {"text": "hello", "rid": "busy", "sampling_params": greedy(3000)}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(client.post, "/generate", json=long))
        await _wait_running(sim_server, 1)
        async with httpx.AsyncClient(base_url=sim_server.url) as other:
            response = await other.post("/generate", json={**long, "sampling_params": greedy(1)})
        assert response.status_code == 400
        assert "Duplicate request ID" in response.json()["error"]["message"]
        assert response.json()["error"]["code"] == 400
        sim_server.eng.abort("busy")


async def test_16_duplicate_rid_in_batch(client: httpx.AsyncClient) -> None:
    body = {"text": ["a", "b"], "rid": ["r", "r"], "sampling_params": greedy(2)}
    response = await client.post("/generate", json=body)
    assert response.status_code == 400
    assert "Duplicate request ID" in response.json()["error"]["message"]
    assert (await client.get("/health")).status_code == 200


async def test_17_abort_all_ends_running_and_queued_requests() -> None:
    config = sim_config(max_running_requests=2)
    async with running_server(config) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            results: list[dict[str, Any]] = []

            async def generate(text: str) -> None:
                response = await client.post(
                    "/generate", json={"text": text, "sampling_params": greedy(3000)}
                )
                assert response.status_code == 200
                results.append(response.json())

            async with trio.open_nursery() as nursery:
                for text in ["first", "second", "third"]:
                    nursery.start_soon(generate, text)
                await _wait_running(server, 2)
                await wait_generated(server, 10)
                response = await client.post("/abort_request", json={"abort_all": True})
                assert response.status_code == 200
    assert len(results) == 3
    for obj in results:
        meta = obj["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert meta["completion_tokens"] == len(obj["output_ids"])
        assert meta["weight_version"] == "default"
        assert meta["e2e_latency"] > 0
    queued = [o for o in results if o["meta_info"]["completion_tokens"] == 0]
    running = [o for o in results if o["meta_info"]["completion_tokens"] > 0]
    assert len(queued) == 1 and len(running) == 2
    assert queued[0]["meta_info"]["finish_reason"]["message"] == "Abort in waiting queue"
    assert all(o["text"] for o in running)


async def test_abort_request_aborts_the_rid_and_its_batch_items_only(
    sim_server: Server, client: httpx.AsyncClient
) -> None:
    body = {"text": ["x", "y"], "rid": "job", "sampling_params": greedy(3000)}
    bystander = {"text": "z", "rid": "job-12", "sampling_params": greedy(200)}
    async with trio.open_nursery() as nursery:
        results: list[Any] = []
        spared: list[Any] = []

        async def run() -> None:
            results.append((await client.post("/generate", json=body)).json())

        async def run_bystander() -> None:
            async with httpx.AsyncClient(base_url=sim_server.url, timeout=30) as own:
                spared.append((await own.post("/generate", json=bystander)).json())

        nursery.start_soon(run)
        nursery.start_soon(run_bystander)
        await _wait_running(sim_server, 3)
        async with httpx.AsyncClient(base_url=sim_server.url) as other:
            response = await other.post("/abort_request", json={"rid": "job"})
        assert response.status_code == 200 and response.text == ""
    items = results[0]
    assert [i["meta_info"]["id"] for i in items] == ["job_0", "job_1"]
    assert all(i["meta_info"]["finish_reason"]["type"] == "abort" for i in items)
    # "job-12" shares the prefix but is another client's request: it ran to its end.
    assert spared[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 200}


async def test_23_runner_failure_is_one_batch_entry() -> None:
    # One running slot: item 0 runs and meets the injected failure at step 3; item 1 is
    # admitted afterwards and completes.
    config = sim_config(max_running_requests=1, sim_fail_at_step=3)
    async with running_server(config) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            body = {"text": ["abc", "de"], "sampling_params": greedy(5)}
            response = await client.post("/generate", json=body)
    assert response.status_code == 200
    failed, ok = response.json()
    assert failed["error"]["code"] == 500
    assert "injected failure" in failed["error"]["message"]
    assert ok["meta_info"]["completion_tokens"] == 5


async def test_23_runner_failure_in_stream_is_an_indexed_error_item() -> None:
    config = sim_config(max_running_requests=1, sim_fail_at_step=3)
    async with running_server(config) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            body = {"text": ["abc", "de"], "stream": True, "sampling_params": greedy(5)}
            response = await client.post("/generate", json=body)
    assert response.status_code == 200
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and errors[0]["index"] == 0 and errors[0]["error"]["code"] == 500
    # The failed item's output so far (2 tokens from steps 1-2) was sent before its error.
    item0 = [e for e in events[:-1] if e.get("index") == 0 and "error" not in e]
    assert item0 and item0[-1]["meta_info"]["completion_tokens"] == 2
    assert events.index(errors[0]) > events.index(item0[-1])
    finals = [e for e in events[:-1] if e.get("index") == 1 and e["meta_info"]["finish_reason"]]
    assert finals[0]["meta_info"]["completion_tokens"] == 5


#: SGLang's answer to a unary /generate the queue cannot take (its HTTPException handler's
#: body: note the status as a string in `type`).
QUEUE_FULL_BODY = {
    "object": "error",
    "message": "The request queue is full.",
    "type": "503",
    "param": None,
    "code": 503,
}
QUEUE_FULL_REASON = {
    "type": "abort",
    "message": "The request queue is full.",
    "status_code": 503,
    "err_type": None,
}


async def test_queue_full_is_503_with_retry_after() -> None:
    config = sim_config(max_running_requests=1, max_queued_requests=1)
    async with running_server(config) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            long = {"text": "x", "sampling_params": greedy(3000)}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(client.post, "/generate", json=long))
                await wait_counts(server, running=1, waiting=0)
                nursery.start_soon(partial(client.post, "/generate", json=long))
                await wait_counts(server, running=1, waiting=1)
                async with httpx.AsyncClient(base_url=server.url) as other:
                    response = await other.post("/generate", json=long)
                    assert response.status_code == 503
                    assert response.headers["retry-after"] == "1"
                    assert response.headers["content-type"] == "application/json"
                    assert list(response.json().items()) == list(QUEUE_FULL_BODY.items())
                    batch = await other.post("/generate", json={**long, "text": ["x", "y"]})
                    assert batch.status_code == 503 and batch.json() == QUEUE_FULL_BODY
                    server.eng.abort_all()
                    short = {"text": "x", "stream": True, "sampling_params": greedy(2)}
                    response = await other.post("/generate", json=short)
                    assert response.status_code == 200  # room again once the queue drained
                    assert parse_sse(response.text)[-1] == "[DONE]"


async def test_queue_full_stream_is_a_200_with_an_abort_frame_per_item() -> None:
    # Two slots, both busy, no queue: nothing more can be taken.
    config = sim_config(max_running_requests=2, max_queued_requests=0)
    async with running_server(config) as server:
        busy = [
            server.eng.submit(
                GenerateRequest(
                    text="busy", sampling=SamplingParams.from_dict({"max_new_tokens": 3000})
                )
            )
            for _ in range(2)
        ]
        await wait_until(lambda: server.eng.stats().running == 2)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            single = {"text": "x", "rid": "mine", "stream": True, "sampling_params": greedy(4)}
            response = await client.post("/generate", json=single)
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            frame, done = parse_sse(response.text)
            assert done == "[DONE]"
            assert list(frame) == ["text", "output_ids", "meta_info"]
            assert frame["text"] == "" and frame["output_ids"] == []
            meta = frame["meta_info"]
            assert list(meta) == [*META_KEYS, "e2e_latency"]
            assert meta["id"] == "mine" and meta["finish_reason"] == QUEUE_FULL_REASON
            assert meta["prompt_tokens"] == meta["completion_tokens"] == 0
            assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] >= 0

            no_rid = await client.post("/generate", json={**single, "rid": None})
            (frame, _) = parse_sse(no_rid.text)
            assert len(frame["meta_info"]["id"]) == 32  # a fresh uuid, as the engine gives

            # A batch is all or nothing: every item gets its own abort frame, by index.
            batch = {**single, "text": ["a", "b"], "rid": "job"}
            events = parse_sse((await client.post("/generate", json=batch)).text)
            assert events[-1] == "[DONE]" and len(events) == 3
            assert [e["index"] for e in events[:-1]] == [0, 1]
            assert [e["meta_info"]["id"] for e in events[:-1]] == ["job_0", "job_1"]
            assert all(e["meta_info"]["finish_reason"] == QUEUE_FULL_REASON for e in events[:-1])
            samples = {**single, "sampling_params": greedy(4, n=2)}
            events = parse_sse((await client.post("/generate", json=samples)).text)
            assert [e["index"] for e in events[:-1]] == [0, 1] and events[-1] == "[DONE]"
            assert server.eng.stats().waiting == 0  # nothing was submitted
            assert server.eng.stats().running == 2

            for stream in busy:
                stream.close()
            await wait_until(lambda: server.eng.stats().running == 0)
            response = await client.post("/generate", json=single)
            events = parse_sse(response.text)
            assert events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
            assert events[-2]["text"] and events[-1] == "[DONE]"


async def test_30_null_resets_defaults_and_null_max_new_tokens_is_unbounded() -> None:
    async with running_server(sim_config(context_length=64)) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            nulls = {"temperature": None, "top_p": None, "max_new_tokens": 3}
            ok = await client.post("/generate", json={"text": "hi", "sampling_params": nulls})
            assert ok.json()["meta_info"]["completion_tokens"] == 3
            unbounded = {"max_new_tokens": None, "temperature": 0}
            body = {"text": "hello", "sampling_params": unbounded}
            response = await client.post("/generate", json=body)
    meta = response.json()["meta_info"]
    assert meta["completion_tokens"] == 64 - 5  # the rest of the context
    assert meta["finish_reason"] == {"type": "length", "length": 59}


async def test_unknown_top_level_keys_are_ignored(client: httpx.AsyncClient) -> None:
    body = {"text": "hi", "sampling_params": greedy(2), "not_a_field": [1], "log_metrics": False}
    response = await client.post("/generate", json=body)
    assert response.status_code == 200
    assert response.json()["meta_info"]["completion_tokens"] == 2


async def test_input_ids_prompts(client: httpx.AsyncClient) -> None:
    single = await client.post(
        "/generate", json={"input_ids": [107, 108], "sampling_params": greedy(2)}
    )
    assert single.json()["meta_info"]["prompt_tokens"] == 2
    batch = await client.post(
        "/generate", json={"input_ids": [[107], [107, 108, 109]], "sampling_params": greedy(2)}
    )
    assert [i["meta_info"]["prompt_tokens"] for i in batch.json()] == [1, 3]


async def test_put_is_accepted(client: httpx.AsyncClient) -> None:
    response = await client.put("/generate", json={"text": "hi", "sampling_params": greedy(1)})
    assert response.status_code == 200


async def _wait_running(server: Server, running: int) -> None:
    with trio.fail_after(10):
        while server.eng.stats().running < running:
            await trio.sleep(0.001)


async def wait_counts(server: Server, *, running: int, waiting: int) -> None:
    with trio.fail_after(10):
        while (server.eng.stats().running, server.eng.stats().waiting) != (running, waiting):
            await trio.sleep(0.001)


async def wait_generated(server: Server, tokens: int) -> None:
    start = server.eng.stats().generated_tokens
    with trio.fail_after(10):
        while server.eng.stats().generated_tokens < start + tokens:
            await trio.sleep(0.001)


async def test_eos_ends_generation_in_output_ids_not_text(client: httpx.AsyncClient) -> None:
    # The sim runner forces a token with a positive logit_bias; 2 is one of its EOS ids.
    body = {"text": "hi", "sampling_params": greedy(10, logit_bias={"2": 100}, min_new_tokens=0)}
    meta_and_ids = (await client.post("/generate", json=body)).json()
    assert meta_and_ids["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert meta_and_ids["output_ids"] == [2] and meta_and_ids["text"] == ""


async def test_stop_string_is_trimmed_from_text(client: httpx.AsyncClient) -> None:
    full = (
        await client.post("/generate", json={"text": "hi", "sampling_params": greedy(12)})
    ).json()
    stop = full["text"][4:6]
    body = {"text": "hi", "sampling_params": greedy(12, stop=stop)}
    cut = (await client.post("/generate", json=body)).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == full["text"][: full["text"].index(stop)]
