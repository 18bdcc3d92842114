"""`--max-request-bytes` over real sockets: a declared Content-Length past the limit and a
chunked body that grows past it both get a 413 in the error shape while the client is still
sending (the rest of the body is never needed), the connection is closed, and the server
keeps serving. A request whose body has not arrived by its deadline gets a 408."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio
from apphelpers import greedy, host_port, running_server, server_settings, sim_config

LIMIT = 64 * 1024
#: How long the server may take to answer; far more than it needs.
ANSWER_WITHIN = 10.0


@asynccontextmanager
async def server() -> AsyncIterator[str]:
    settings = server_settings(max_request_bytes=LIMIT)
    async with running_server(sim_config(), settings) as running:
        yield running.url


async def connect(url: str) -> trio.SocketStream:
    return await trio.open_tcp_stream(*host_port(url))


async def read_response(stream: trio.SocketStream) -> tuple[int, dict[str, str], Any]:
    """One HTTP/1.1 response with a Content-Length body: (status, headers, JSON body)."""
    data = b""
    with trio.fail_after(ANSWER_WITHIN):
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some()
            assert chunk, f"connection closed before a response: {data!r}"
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        while len(body) < int(headers["content-length"]):
            body += await stream.receive_some()
    return int(status_line.split()[1]), headers, json.loads(body)


def request_head(path: str, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


TOO_LARGE = {
    "error": {
        "message": f"The request body is larger than this server accepts ({LIMIT} bytes, "
        "--max-request-bytes).",
        "code": 413,
    }
}


async def assert_closed(stream: trio.SocketStream) -> None:
    """The server closed the connection (the rest of the refused body is never read)."""
    with trio.fail_after(ANSWER_WITHIN):
        assert await stream.receive_some() == b""


async def assert_still_serving(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/health")).status_code == 200
        body = {"text": "hi", "sampling_params": greedy(2)}
        assert (await client.post("/generate", json=body)).status_code == 200


async def test_a_declared_content_length_past_the_limit_is_refused_before_the_body() -> None:
    async with server() as url:
        for path in ("/generate", "/v1/completions"):
            stream = await connect(url)
            async with stream:
                # 100 MiB announced, 1 KiB sent: the answer cannot have waited for the rest.
                head = request_head(path, f"Content-Length: {100 * 1024 * 1024}")
                await stream.send_all(head + b'{"text": "' + b"x" * 1024)
                status, _, body = await read_response(stream)
                await assert_closed(stream)
            assert status == 413
            if path == "/generate":
                assert body == TOO_LARGE
            else:
                assert body["error"]["message"] == TOO_LARGE["error"]["message"]
                assert body["error"]["type"] == "invalid_request_error"
        await assert_still_serving(url)


async def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit() -> None:
    async with server() as url:
        stream = await connect(url)
        async with stream:
            await stream.send_all(request_head("/generate", "Transfer-Encoding: chunked"))
            piece = b'{"text": "' + b"x" * (16 * 1024)
            for _ in range(LIMIT // len(piece) + 1):  # just past the limit, never the end
                await stream.send_all(b"%x\r\n%s\r\n" % (len(piece), piece))
            status, _, body = await read_response(stream)
            await assert_closed(stream)
        assert (status, body) == (413, TOO_LARGE)
        await assert_still_serving(url)


async def test_a_chunked_body_under_the_limit_is_served() -> None:
    async with server() as url:
        payload = json.dumps({"text": "hi " * 1000, "sampling_params": greedy(2)}).encode()

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(payload), 1000):
                yield payload[i : i + 1000]

        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/generate", content=chunks(), headers={"Content-Type": "application/json"}
            )
        assert response.request.headers["transfer-encoding"] == "chunked"
        assert response.status_code == 200
        assert response.json()["meta_info"]["completion_tokens"] == 2


async def test_a_body_that_has_not_arrived_by_the_deadline_is_a_408() -> None:
    async with server() as url:
        stream = await connect(url)
        async with stream:
            head = request_head("/generate", "Content-Length: 100", "X-Request-Timeout: 0.3")
            await stream.send_all(head + b'{"text": ')  # and then nothing
            status, _, body = await read_response(stream)
        assert (status, body) == (
            408,
            {"error": {"message": "Request timed out after 0.3 s.", "code": 408}},
        )
        await assert_still_serving(url)
