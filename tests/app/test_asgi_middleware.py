"""The two ASGI middlewares every app runs under, on fake ASGI apps (no server)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from tributary.app.http.asgi import CloseOwned, ShieldFinalSend, owned_by_request


class Resource:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


async def receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


@pytest.mark.parametrize("ending", ["return", "raise", "cancel"])
async def test_owned_resources_are_closed_however_the_exchange_ends(ending: str) -> None:
    resource = Resource()

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        owned_by_request(scope).append(resource)
        if ending == "raise":
            raise RuntimeError("view failed")
        if ending == "cancel":
            await trio.sleep_forever()

    async def send(message: dict[str, Any]) -> None:
        pass

    with trio.move_on_after(1) as scope:
        try:
            await CloseOwned(inner)({"type": "http"}, receive, send)
        except RuntimeError:
            assert ending == "raise"
    assert resource.closed == 1
    assert scope.cancelled_caught == (ending == "cancel")


class AsyncResource:
    """Closed only with an await, as a worker's response a front relays."""

    def __init__(self) -> None:
        self.closed = 0

    async def aclose(self) -> None:
        await trio.sleep(0.01)  # a checkpoint: it would raise Cancelled unless shielded
        self.closed += 1


async def test_an_owned_resource_closed_with_an_await_is_awaited_even_when_cancelled() -> None:
    resource, plain = AsyncResource(), Resource()

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        owned_by_request(scope).extend([resource, plain])
        await trio.sleep_forever()

    async def send(message: dict[str, Any]) -> None:
        pass

    with trio.move_on_after(1):
        await CloseOwned(inner)({"type": "http"}, receive, send)
    assert resource.closed == 1 and plain.closed == 1


async def test_only_the_final_body_send_is_shielded() -> None:
    completed: list[str] = []

    async def send(message: dict[str, Any]) -> None:
        await trio.sleep(0)  # a checkpoint: raises Cancelled unless shielded
        completed.append(message["type"] + ("+more" if message.get("more_body") else ""))

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        with trio.CancelScope() as cancelled:
            cancelled.cancel()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            with pytest.raises(trio.Cancelled):
                await send({"type": "http.response.body", "body": b"x", "more_body": True})

    await ShieldFinalSend(inner)({"type": "http"}, receive, send)
    assert completed == ["http.response.body"]
