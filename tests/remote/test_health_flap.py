"""One slow health probe must not take a working fleet out of service.

Seen in `bench/scale_out.py --quick` on a loaded machine (load average 6): a front over two
working Tributary workers (one idle) answered all 20 requests at once with 503 "No worker is
available to serve the request." One probe round that misses `health_check_timeout` (2 s)
marks every worker unhealthy until the next round (5 s later), and a request meanwhile is
refused without being tried anywhere. SGLang's gateway (which the health module cites) wants
3 failed probes before it takes a worker out.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import trio
from hypercorn.trio import serve
from test_sglang_replay import FakeSGLang, body

from tributary import app, testing
from tributary.app.server import hypercorn_config
from tributary.engine.remote import RemoteConfig, open_remote_engine


class SlowOnceHealth:
    """A working SGLang-like worker whose second `/health` answers after `delay` seconds."""

    def __init__(self, delay: float) -> None:
        self.inner = FakeSGLang(incremental=False)
        self.delay = delay
        self.probes = 0
        self.slow_probe = trio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/health":
            self.probes += 1
            if self.probes == 2:
                self.slow_probe.set()
                await trio.sleep(self.delay)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.inner(scope, receive, send)


async def test_one_slow_probe_does_not_refuse_requests_to_a_working_worker() -> None:
    worker = SlowOnceHealth(delay=1.0)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve, worker, hypercorn_config(testing.server_settings()))
        )
        config = RemoteConfig(
            workers=((binds[0], "sglang"),),
            health_check_interval=0.3,
            health_check_timeout=0.1,
            retry_backoff=0.01,
        )
        async with (
            open_remote_engine(config) as front,
            app.open_http_server(front, testing.server_settings()) as urls,
            httpx.AsyncClient(timeout=10) as client,
        ):
            await worker.slow_probe.wait()
            await trio.sleep(0.15)  # past the probe's timeout, before the next round
            answer = await client.post(f"{urls[0]}/generate", json=body("paris", "r"))
            assert answer.status_code == 200, answer.text
        nursery.cancel_scope.cancel()
