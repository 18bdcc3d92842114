"""`open_http_server` and `serve`: bound URLs, graceful exit, hard stop, unwrapped errors, and
the Hypercorn traps they design around (keep-alive after a Quart-Trio response,
TCP_USER_TIMEOUT)."""

from __future__ import annotations

import socket
from functools import partial

import httpx
import pytest
import trio
from apphelpers import greedy, host_port, parse_sse, server_settings, sim_config, wait_until

from tributary import app, engine
from tributary.app import server


async def test_port_zero_binds_a_free_port_and_serve_works_with_nursery_start() -> None:
    async with engine.open_engine(sim_config()) as eng:
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(partial(app.serve, eng, server_settings()))
            assert urls[0].startswith("http://127.0.0.1:") and not urls[0].endswith(":0")
            async with httpx.AsyncClient(base_url=urls[0]) as client:
                assert (await client.get("/health")).status_code == 200
            nursery.cancel_scope.cancel()


async def test_graceful_exit_finishes_in_flight_requests_and_drains() -> None:
    results: list[httpx.Response] = []
    health_while_draining: list[tuple[int, int]] = []
    async with engine.open_engine(sim_config()) as eng:
        quart_app = app.create_app(eng, server_settings(graceful_timeout=5.0))

        async def watch_health() -> None:
            # Observed from beside the server while open_http_server waits for the drain.
            await wait_until(lambda: app.server_state(quart_app).draining)
            response = await quart_app.test_client().get("/health")
            health_while_draining.append((response.status_code, eng.stats().running))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_health)
            # No settings given: the app's own (port 0, 5 s graceful timeout) are used.
            async with app.open_http_server(quart_app) as urls:
                assert not urls[0].endswith(":30000")
                client = httpx.AsyncClient(base_url=urls[0], timeout=30)

                async def generate() -> None:
                    body = {"text": "hi", "sampling_params": greedy(200)}
                    results.append(await client.post("/generate", json=body))
                    await client.aclose()

                nursery.start_soon(generate)
                await wait_until(lambda: eng.stats().running == 1)
            # The block has exited: the in-flight request finished normally first.
            assert app.server_state(quart_app).draining
    assert results[0].status_code == 200
    assert results[0].json()["meta_info"]["completion_tokens"] == 200
    assert health_while_draining == [(503, 1)]  # 503 while the request was still generating


async def test_cancelling_the_block_is_a_hard_stop() -> None:
    async with engine.open_engine(sim_config()) as eng:
        errors: list[BaseException] = []
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as scope:
                async with app.open_http_server(eng, server_settings(graceful_timeout=30)) as urls:

                    async def generate() -> None:
                        async with httpx.AsyncClient(base_url=urls[0]) as client:
                            try:
                                body = {"text": "hi", "sampling_params": greedy(3000)}
                                await client.post("/generate", json=body)
                            except httpx.HTTPError as exc:
                                errors.append(exc)

                    nursery.start_soon(generate)
                    await wait_until(lambda: eng.stats().running == 1)
                    cancelled_at = trio.current_time()
                    scope.cancel()
            assert trio.current_time() - cancelled_at < 1.0  # not the 30 s graceful timeout
        assert errors and isinstance(errors[0], httpx.RemoteProtocolError | httpx.ReadError)
        await wait_until(lambda: eng.stats().running == 0)


async def test_errors_in_the_block_reach_the_caller_unwrapped() -> None:
    async with engine.open_engine(sim_config()) as eng:
        with pytest.raises(KeyError, match="boom"):
            async with app.open_http_server(eng, server_settings()):
                raise KeyError("boom")


STREAM_BODY = b'{"text": "hi", "stream": true, "sampling_params": {"max_new_tokens": 8}}'


@pytest.mark.parametrize(
    ("request_bytes", "end"),
    [
        (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"\r\n\r\n"),
        (
            b"POST /generate HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(STREAM_BODY), STREAM_BODY),
            b"data: [DONE]\n\n\r\n0\r\n\r\n",  # the last event, then the chunked end
        ),
    ],
    ids=["unary", "stream"],
)
async def test_idle_keep_alive_connection_is_closed_after_a_response(
    request_bytes: bytes, end: bytes
) -> None:
    # Without ShieldFinalSend the idle timer is never armed after a Quart-Trio response and
    # the connection would stay open until shutdown (trio-stack-notes 2.3). A stream's
    # writes mostly bypass Hypercorn's send (app/http/direct_send.py); its timers must not.
    async with engine.open_engine(sim_config()) as eng:
        async with app.open_http_server(eng, server_settings(keep_alive_timeout=0.5)) as urls:
            stream = await trio.open_tcp_stream(*host_port(urls[0]))
            async with stream:
                await stream.send_all(request_bytes)
                response = b""
                with trio.fail_after(5):
                    while not response.endswith(end):
                        data = await stream.receive_some()
                        assert data, f"closed before the response ended: {response!r}"
                        response += data
                assert response.startswith(b"HTTP/1.1 200")
                start = trio.current_time()
                with trio.fail_after(3):
                    while await stream.receive_some():
                        pass  # nothing more comes; EOF is the close
                assert 0.4 < trio.current_time() - start < 2.0


def test_listening_sockets_carry_tcp_user_timeout() -> None:
    config = app.ServerConfig()
    config.bind = ["127.0.0.1:0"]
    config.user_timeout_ms = 12_345
    sockets = config.create_sockets()
    try:
        (sock,) = sockets.insecure_sockets
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 12_345
    finally:
        for sock in sockets.insecure_sockets:
            sock.close()


def test_settings_bind_brackets_ipv6() -> None:
    assert app.ServerSettings(host="::1", port=8).bind == "[::1]:8"
    assert app.ServerSettings(host="0.0.0.0", port=8).bind == "0.0.0.0:8"


async def test_a_port_in_use_is_a_plain_oserror() -> None:
    async with engine.open_engine(sim_config()) as eng:
        async with app.open_http_server(eng, server_settings()) as urls:
            port = int(urls[0].rsplit(":", 1)[1])
            with pytest.raises(OSError):
                async with app.open_http_server(eng, server_settings(port=port)):
                    pass  # pragma: no cover - never reached


async def test_requests_outliving_the_graceful_timeout_end_with_a_readable_503() -> None:
    """Near the graceful deadline, leftovers are aborted with status 503: a stream ends with
    an error item and [DONE], a unary request gets a 503 body; nothing is cut mid-response."""
    streamed: list[str] = []
    unary: list[httpx.Response] = []
    async with engine.open_engine(sim_config()) as eng:
        settings = server_settings(graceful_timeout=1.0)
        async with trio.open_nursery() as nursery:
            async with app.open_http_server(eng, settings) as urls:
                client = httpx.AsyncClient(base_url=urls[0], timeout=30)

                async def stream() -> None:
                    body = {"text": "hi", "stream": True, "sampling_params": greedy(4000)}
                    async with client.stream("POST", "/generate", json=body) as response:
                        streamed.append((await response.aread()).decode())

                async def generate() -> None:
                    body = {"text": "hi", "sampling_params": greedy(4000)}
                    unary.append(await client.post("/generate", json=body))

                nursery.start_soon(stream)
                nursery.start_soon(generate)
                await wait_until(lambda: eng.stats().running == 2)
            shut_at = trio.current_time()
        # Both ended at 80% of the graceful timeout, not at the deadline.
        assert trio.current_time() - shut_at < 1.0
        await client.aclose()
    events = parse_sse(streamed[0])
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "The server is shutting down.", "code": 503}}
    assert unary[0].status_code == 503
    assert unary[0].json() == {"error": {"message": "The server is shutting down.", "code": 503}}


async def test_leftovers_are_aborted_a_long_step_before_the_graceful_deadline(
    autojump_clock: trio.abc.Clock,
) -> None:
    """With steps longer than 20% of the graceful timeout, aborting at 80% would leave the
    503 waiting for a step boundary past the deadline (and the connection would be cut):
    the abort comes early enough for the slowest recent step to end before the deadline."""
    graceful_timeout = 1.0
    slow = engine.SimLatency(step_base=0.6, decode_per_seq=0.0, prefill_per_token=0.0)
    async with engine.open_engine(sim_config(sim_latency=slow)) as eng:
        params = engine.SamplingParams.from_dict(greedy(1000))
        stream = eng.submit(engine.GenerateRequest(text="hi", sampling=params))
        for _ in range(3):  # a few steps, so the engine knows how long one takes
            await stream.__anext__()
        shutdown_at = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.abort_leftovers, eng, graceful_timeout)
            async with stream:
                last = [item async for item in stream][-1]
            ended_at = trio.current_time()
    assert isinstance(last, engine.Done)
    assert last.finish_reason["status_code"] == 503
    assert ended_at - shutdown_at < graceful_timeout


async def test_a_slow_step_still_lets_leftovers_read_their_503() -> None:
    """Over a real socket: a stream on an engine whose steps take 0.4 s, shut down with a 1 s
    graceful timeout, ends with the 503 error item and [DONE], not a cut connection."""
    slow = engine.SimLatency(step_base=0.4, decode_per_seq=0.0, prefill_per_token=0.0)
    streamed: list[str] = []
    async with engine.open_engine(sim_config(sim_latency=slow)) as eng:
        async with trio.open_nursery() as nursery:
            async with app.open_http_server(eng, server_settings(graceful_timeout=1.0)) as urls:
                client = httpx.AsyncClient(base_url=urls[0], timeout=30)

                async def stream() -> None:
                    body = {"text": "hi", "stream": True, "sampling_params": greedy(1000)}
                    async with client.stream("POST", "/generate", json=body) as response:
                        async for chunk in response.aiter_text():
                            streamed.append(chunk)

                nursery.start_soon(stream)
                await wait_until(lambda: eng.stats().steps >= 3)
        await client.aclose()
    events = parse_sse("".join(streamed))
    assert events[-2:] == [
        {"error": {"message": "The server is shutting down.", "code": 503}},
        "[DONE]",
    ]


async def test_a_long_prefill_queued_at_shutdown_still_gets_its_503_in_time(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The margin is measured from the steps run before
    shutdown began (here only short ones); a request still queued then, admitted while
    draining, would run a far longer first prefill chunk and get its 503 after the graceful
    deadline (1.09 s of 1.0 without this). Queued requests get their 503 at once,
    while the running one finishes."""
    graceful_timeout = 1.0
    lat = engine.SimLatency(step_base=0.01, decode_per_seq=0.0, prefill_per_token=0.002)
    config = sim_config(sim_latency=lat, max_running_requests=1)
    async with engine.open_engine(config) as eng:
        short = eng.submit(
            engine.GenerateRequest(text="hi", sampling=engine.SamplingParams.from_dict(greedy(60)))
        )
        queued = eng.submit(
            engine.GenerateRequest(
                text="x " * 400, sampling=engine.SamplingParams.from_dict(greedy(1000))
            )
        )
        for _ in range(3):
            await short.__anext__()
        shutdown_at = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.abort_leftovers, eng, graceful_timeout)
            async with short:
                assert [item async for item in short][-1].finish_reason["type"] == "length"
            async with queued:
                last = [item async for item in queued][-1]
            ended_at = trio.current_time()
    assert isinstance(last, engine.Done)
    assert last.finish_reason["status_code"] == 503
    assert ended_at - shutdown_at < graceful_timeout, ended_at - shutdown_at
