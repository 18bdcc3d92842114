"""Slow readers: 50 SSE clients that stop reading mid-stream while others are served.

The stalled clients are raw sockets with a tiny receive buffer that read the response
headers and then nothing. Their streams are cumulative (each frame repeats all text and ids
so far), so the kernel buffers on both sides fill within a fraction of a second; from then
on the server's writes to them block. The test checks that:

- the other clients' streams complete, correctly, about as fast as with the same 50
  sequences generating for a consumer that reads (a loose bound: within 2x; a slow reader
  that blocked the server would stall them for the whole TCP_USER_TIMEOUT);
- the stalled clients are dropped once TCP_USER_TIMEOUT (2 s here) has run out, not before,
  and their sequences are freed long before they could have finished.

Real sockets and real time: this is the one test whose timing cannot be virtual (a kernel
timer drops the connections). It takes about 5 s.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import trio
from apphelpers import raw_socket

from tributary.engine import Engine, GenerateRequest, SamplingParams, SimLatency
from tributary.testing import (
    collect,
    open_server,
    parse_sse,
    server_settings,
    sim_config,
    wait_engine_idle,
)

STALLED = 50
OTHERS, OTHER_TOKENS = 4, 100
TCP_USER_TIMEOUT = 2.0
#: The stalled streams would take many seconds to finish on their own.
STALLED_TOKENS = 7000
#: Steps cost the same however many sequences run, so only what the slow readers do to the
#: server can change the others' pace.
ENGINE = sim_config(
    max_running_requests=64,
    context_length=8192,
    sim_latency=SimLatency(step_base=0.002, decode_per_seq=0.0, prefill_per_token=0.0),
)
STALLED_BODY = {
    "text": "x" * 50,
    "stream": True,
    "sampling_params": {"max_new_tokens": STALLED_TOKENS, "temperature": 0},
}


async def stalled_client(url: str, sockets: list[trio.socket.SocketType]) -> None:
    """Send a long stream request, read the first bytes of the answer, then stop reading."""
    sock = await raw_socket(url, receive_buffer=4096)
    body = json.dumps(STALLED_BODY).encode()
    head = (
        "POST /generate HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    await sock.send(head.encode() + body)
    assert (await sock.recv(64)).startswith(b"HTTP/1.1 200")
    sockets.append(sock)


async def others_seconds(url: str) -> float:
    """Run the other clients' streams together; the slowest one's seconds. Each must be
    complete and correct."""
    durations: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        start = time.monotonic()
        body = {
            "text": f"other {i}",
            "stream": True,
            "sampling_params": {"max_new_tokens": OTHER_TOKENS, "temperature": 0},
        }
        reply = await client.post("/generate", json=body)
        durations.append(time.monotonic() - start)
        events = parse_sse(reply.text)
        assert events[-1] == "[DONE]"
        assert events[-2]["meta_info"]["completion_tokens"] == OTHER_TOKENS

    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async with trio.open_nursery() as nursery:
            for i in range(OTHERS):
                nursery.start_soon(one, client, i)
    return max(durations)


async def wait_running(engine: Engine, count: int) -> None:
    with trio.fail_after(10):
        while engine.stats().running < count:
            await trio.sleep(0.005)


async def test_stalled_readers_are_dropped_and_do_not_slow_the_others() -> None:
    settings = server_settings(tcp_user_timeout=TCP_USER_TIMEOUT)
    async with open_server(ENGINE, settings) as server:
        engine = server.engine
        # Control: the same 50 long sequences, read by consumers that keep up.
        sampling = SamplingParams.from_dict(STALLED_BODY["sampling_params"])
        streams = [engine.submit(GenerateRequest(text="x" * 50, sampling=sampling))
                   for _ in range(STALLED)]  # fmt: skip
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(collect, stream)
            await wait_running(engine, STALLED)
            await trio.sleep(0.5)
            control = await others_seconds(server.url)
            nursery.cancel_scope.cancel()
        await wait_engine_idle(engine)

        sockets: list[Any] = []
        stalled_at = time.monotonic()
        async with trio.open_nursery() as nursery:
            for _ in range(STALLED):
                nursery.start_soon(stalled_client, server.url, sockets)
        await wait_running(engine, STALLED)
        await trio.sleep(0.5)  # the buffers fill (they do within ~0.3 s here)
        tokens_before = engine.stats().generated_tokens
        with_stalled = await others_seconds(server.url)
        print(f"others: {control:.2f} s beside readers, {with_stalled:.2f} s beside stalled ones")
        assert with_stalled < 2 * control + 0.25

        with trio.fail_after(TCP_USER_TIMEOUT + 8):
            while engine.stats().running:
                await trio.sleep(0.01)
        dropped_after = time.monotonic() - stalled_at
        print(f"stalled clients dropped {dropped_after:.2f} s after they stopped reading")
        assert dropped_after >= TCP_USER_TIMEOUT
        await wait_engine_idle(engine)
        generated = engine.stats().generated_tokens - tokens_before
        assert generated < STALLED * STALLED_TOKENS // 4  # aborted, far from their end

        for sock in sockets:  # the server reset every stalled connection
            assert await connection_was_cut(sock)
            sock.close()
        async with httpx.AsyncClient(base_url=server.url) as client:
            assert (await client.get("/health")).status_code == 200


async def connection_was_cut(sock: trio.socket.SocketType) -> bool:
    """Read what the kernel still holds; True if that ends in a reset or an end of stream
    without the stream's `[DONE]`."""
    data = b""
    with trio.fail_after(10):
        while True:
            try:
                chunk = await sock.recv(1 << 20)
            except ConnectionResetError:
                return True
            if not chunk:
                return b"data: [DONE]" not in data[-64:]
            data = data[-64:] + chunk
