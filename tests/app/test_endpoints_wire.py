"""The endpoints around `/generate`: health, model and server info, abort, flush."""

from __future__ import annotations

import httpx
import pytest
import trio
from apphelpers import ScriptedEngine, Server, greedy, sim_config

from tributary import app, engine
from tributary.engine import Done


async def test_health_is_200_while_serving(client: httpx.AsyncClient) -> None:
    response = await client.get("/health")
    assert response.status_code == 200 and response.text == ""


async def test_health_is_503_while_draining(sim_server: Server) -> None:
    quart_app = app.create_app(sim_server.eng)
    app.server_state(quart_app).draining = True
    test_client = quart_app.test_client()
    assert (await test_client.get("/health")).status_code == 503
    assert (await test_client.get("/health_generate")).status_code == 503


async def test_health_generate_runs_one_token(
    sim_server: Server, client: httpx.AsyncClient
) -> None:
    before = sim_server.eng.stats().generated_tokens
    response = await client.get("/health_generate")
    assert response.status_code == 200
    assert sim_server.eng.stats().generated_tokens == before + 1


async def test_health_generate_is_503_when_the_probe_fails() -> None:
    rejected = {"type": "abort", "message": "no", "status_code": 500, "err_type": None}
    eng = ScriptedEngine(lambda i, rid: [Done(rid, "", [], 1, 0, 0, finish_reason=rejected)])
    response = await app.create_app(eng).test_client().get("/health_generate")  # type: ignore[arg-type]
    assert response.status_code == 503


async def test_health_generate_times_out_and_aborts_its_probe(
    autojump_clock: trio.abc.Clock,
) -> None:
    eng = ScriptedEngine()  # never answers
    settings = app.ServerSettings(health_check_timeout=20.0)
    start = trio.current_time()
    response = await app.create_app(eng, settings).test_client().get("/health_generate")  # type: ignore[arg-type]
    assert response.status_code == 503
    assert trio.current_time() - start == pytest.approx(20.0)
    assert len(eng.aborted) == 1 and eng.aborted[0].startswith("HEALTH_CHECK_")
    assert eng.requests[0].input_ids == [0]
    assert eng.requests[0].sampling.max_new_tokens == 1


@pytest.mark.parametrize("path", ["/get_model_info", "/model_info"])
async def test_model_info(client: httpx.AsyncClient, path: str) -> None:
    response = await client.get(path)
    assert response.status_code == 200
    info = response.json()
    assert info["model_path"] == "sim" and info["is_generation"] is True
    assert info["weight_version"] == "default"
    assert info["context_length"] == 4096
    assert {"tokenizer_path", "preferred_sampling_params", "served_model_name"} <= set(info)


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
async def test_12_server_info_concurrently(
    sim_server: Server, client: httpx.AsyncClient, path: str
) -> None:
    results: list[httpx.Response] = []

    async def get() -> None:
        results.append(await client.get(path))

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(get)
    assert len(results) == 8
    for response in results:
        info = response.json()
        assert response.status_code == 200
        assert isinstance(info["max_total_num_tokens"], int) and info["max_total_num_tokens"] > 0
        assert isinstance(info["version"], str) and info["version"]
        # Started with port 0: the info names the port actually bound.
        assert info["urls"] == [sim_server.url]
        assert info["port"] == int(sim_server.url.rsplit(":", 1)[1]) != 0
        assert info["context_length"] == 4096
        assert info["max_running_requests"] == sim_server.eng.config.max_running_requests
        assert info["incremental_streaming_output"] is False
        assert info["internal_states"][0]["running"] >= 0


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_flush_cache(client: httpx.AsyncClient, method: str) -> None:
    response = await client.request(method, "/flush_cache")
    assert response.status_code == 200 and response.text.startswith("Cache flushed.")


async def test_abort_request_for_unknown_rid_is_200(client: httpx.AsyncClient) -> None:
    response = await client.post("/abort_request", json={"rid": "no-such-request"})
    assert response.status_code == 200
    after = await client.post("/generate", json={"text": "hi", "sampling_params": greedy(2)})
    assert after.status_code == 200


async def test_generate_after_the_engine_closed_is_503() -> None:
    async with engine.open_engine(sim_config()) as eng:
        quart_app = app.create_app(eng)
    response = await quart_app.test_client().post("/generate", json={"text": "hi"})
    assert response.status_code == 503
    body = await response.get_json()
    assert body == {"error": {"message": "The engine is shutting down.", "code": 503}}
    assert (await quart_app.test_client().get("/health_generate")).status_code == 503


@pytest.mark.parametrize("queue_full", [False, True], ids=["slots full", "queue full"])
async def test_health_generate_passes_on_a_busy_server(
    autojump_clock: trio.abc.Clock, queue_full: bool
) -> None:
    """As SGLang: any output counts, so a server whose slots (or queue) are taken by long
    generations is healthy, not a 503 that would get it restarted."""
    config = sim_config(max_running_requests=2, max_queued_requests=1 if queue_full else 8)
    async with engine.open_engine(config) as eng:
        long = engine.SamplingParams.from_dict(greedy(3000))
        streams = []
        for _ in range(3 if queue_full else 2):
            streams.append(eng.submit(engine.GenerateRequest(text="busy", sampling=long)))
            await trio.sleep(0.01)  # admitted: the third waits, and fills the queue
        assert eng.stats().running == 2 and eng.stats().waiting == (1 if queue_full else 0)
        settings = app.ServerSettings(health_check_timeout=2.0)
        start = trio.current_time()
        response = await app.create_app(eng, settings).test_client().get("/health_generate")
        assert response.status_code == 200
        assert trio.current_time() - start < 0.5  # at the first step, not after the timeout
        for stream in streams:
            stream.close()
