"""While the model loads the port answers 503 (not a refused connection), then the real
server takes the same port over; a model that cannot load is a plain error, exit status 2."""

from __future__ import annotations

import dataclasses
import sys

import httpx
import trio
from apphelpers import server_settings, sim_config

from tributary import app, engine
from tributary.app.loading import LOADING_MESSAGE, bound_port, serve_until_loaded


async def test_port_answers_503_while_loading_then_the_server_takes_it_over() -> None:
    settings = server_settings()
    async with trio.open_nursery() as nursery:
        loaded, released = trio.Event(), trio.Event()
        urls = await nursery.start(serve_until_loaded, settings, loaded, released)
        async with httpx.AsyncClient(base_url=urls[0]) as client:
            for method, path in (("GET", "/health"), ("POST", "/generate"), ("GET", "/v1/models")):
                response = await client.request(method, path)
                assert response.status_code == 503
                assert response.headers["retry-after"] == "1"
                assert response.json() == {"error": {"message": LOADING_MESSAGE, "code": 503}}
        async with engine.open_engine(sim_config()) as eng:
            loaded.set()
            with trio.fail_after(5):
                await released.wait()
            pinned = dataclasses.replace(settings, port=bound_port(urls[0]))
            async with app.open_http_server(eng, pinned) as real_urls:
                assert real_urls == urls
                async with httpx.AsyncClient(base_url=real_urls[0]) as client:
                    assert (await client.get("/health")).status_code == 200


async def test_a_model_that_cannot_load_is_a_plain_error() -> None:
    command = [
        sys.executable, "-m", "tributary", "serve", "--model-path", "/nonexistent/model.gguf",
        "--port", "0", "--log-level", "error",
    ]  # fmt: skip
    with trio.fail_after(60):
        done = await trio.run_process(command, capture_stderr=True, check=False)
    assert done.returncode == 2
    assert (
        done.stderr.decode()
        .strip()
        .endswith(
            "tributary: error: model file not found: /nonexistent/model.gguf "
            "(a GGUF file, or one of smollm2-135m, gemma3-270m)"
        )
    )
    assert b"Traceback" not in done.stderr
