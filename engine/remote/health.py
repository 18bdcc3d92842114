# stand-in: replaced by branch fleet
"""Periodic `/health` probes of every worker."""

from __future__ import annotations

import httpx
import trio

from .fleet import Fleet

__all__ = ["run_health_checks"]


async def run_health_checks(
    fleet: Fleet,
    client: httpx.AsyncClient,
    *,
    interval: float = 5.0,
    timeout: float = 2.0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    task_status.started()
    while True:
        for worker in fleet.workers:
            try:
                response = await client.get(f"{worker.url}/health", timeout=timeout)
                worker.healthy = response.status_code == 200
            except httpx.HTTPError:
                worker.healthy = False
        await trio.sleep(interval)
