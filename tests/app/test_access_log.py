"""The access log (`tributary.access`): one line per finished request, as an operator reads it,
as text or as JSON, and never with the prompt unless `--log-requests` asks for it."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import trio
from apphelpers import greedy, wait_until

from tributary import app, engine
from tributary.app.observe.exchange import JsonFormatter
from tributary.testing import DEFAULT_SIM_LATENCY, AppClient, step_time

pytestmark = pytest.mark.tributary_config(sim_latency=DEFAULT_SIM_LATENCY)

PROMPT = "a secret prompt"
HELLO_3 = step_time(prefill=5) + 2 * step_time(decoding=1)


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="tributary.access")
    return caplog


def lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "tributary.access"]


def fields(record: logging.LogRecord) -> dict[str, Any]:
    access: dict[str, Any] = record.__dict__["access"]
    return access


async def test_one_line_per_finished_request(
    tributary_client: AppClient, access: pytest.LogCaptureFixture, autojump_clock: trio.abc.Clock
) -> None:
    body = {"text": "hello", "rid": "r1", "sampling_params": greedy(3)}
    assert (await tributary_client.post("/generate", body)).status == 200
    [record] = lines(access)
    assert fields(record) == {
        "rid": "r1",
        "method": "POST",
        "route": "/generate",
        "status": 200,
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "finish": "length",
        "e2e_latency": pytest.approx(HELLO_3),
        "disconnected": False,
    }
    assert record.getMessage() == (
        "rid=r1 method=POST route=/generate status=200 prompt_tokens=5 completion_tokens=3 "
        f"finish=length e2e_latency={HELLO_3:.6f} disconnected=false"
    )


async def test_batch_items_get_a_line_each(
    tributary_client: AppClient, access: pytest.LogCaptureFixture
) -> None:
    body = {"text": ["hello", "hi"], "rid": "job", "sampling_params": greedy(2)}
    assert (await tributary_client.post("/generate", body)).status == 200
    assert [(f["rid"], f["completion_tokens"]) for f in map(fields, lines(access))] == [
        ("job_0", 2),
        ("job_1", 2),
    ]


async def test_the_prompt_is_never_logged_unless_asked(
    tributary_engine: engine.Engine, access: pytest.LogCaptureFixture
) -> None:
    body = {"text": PROMPT, "sampling_params": greedy(2)}
    await AppClient(app.create_app(tributary_engine)).post("/generate", body)
    await AppClient(app.create_app(tributary_engine)).post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}
    )
    assert len(lines(access)) == 2
    for record in lines(access):
        assert "prompt" not in fields(record)
        assert PROMPT not in record.getMessage()
        assert PROMPT not in JsonFormatter().format(record)
    access.clear()
    logged = app.ServerSettings(log_requests=True)
    await AppClient(app.create_app(tributary_engine, logged)).post("/generate", body)
    [record] = lines(access)
    assert fields(record)["prompt"] == PROMPT
    assert f'prompt="{PROMPT}"' in record.getMessage()


async def test_json_format_is_one_object_per_line(
    tributary_client: AppClient, access: pytest.LogCaptureFixture
) -> None:
    await tributary_client.post(
        "/generate", {"text": "hi", "rid": "j", "sampling_params": greedy(1)}
    )
    [record] = lines(access)
    line = JsonFormatter().format(record)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["level"] == "INFO" and obj["logger"] == "tributary.access"
    assert {k: obj[k] for k in ("rid", "route", "status", "finish", "disconnected")} == {
        "rid": "j",
        "route": "/generate",
        "status": 200,
        "finish": "length",
        "disconnected": False,
    }
    other = logging.LogRecord("tributary.cli", logging.INFO, __file__, 1, "hi %s", ("x",), None)
    assert json.loads(JsonFormatter().format(other))["message"] == "hi x"


async def test_a_client_that_left_is_logged_as_disconnected(
    tributary_engine: engine.Engine,
    tributary_client: AppClient,
    access: pytest.LogCaptureFixture,
    autojump_clock: trio.abc.Clock,
) -> None:
    body = {"text": "hello", "rid": "gone", "stream": True, "sampling_params": greedy(1000)}
    async with tributary_client.stream("POST", "/generate", json=body) as conn:
        await conn.next_event()
        await conn.disconnect()
    [record] = lines(access)
    line = fields(record)
    assert (line["rid"], line["status"], line["disconnected"]) == ("gone", 200, True)
    assert line["finish"] is None and line["e2e_latency"] is None
    # A unary request whose client leaves before any status was sent: 499. (The stream's
    # sequence stays running until the next step boundary reaps it: wait for that, or
    # `running == 1` below would hold before the unary request was even submitted.)
    await wait_until(lambda: tributary_engine.stats().running == 0)
    access.clear()
    unary = {"text": "hello", "rid": "gone2", "sampling_params": greedy(1000)}
    async with tributary_client.stream("POST", "/generate", json=unary) as conn:
        await wait_until(lambda: tributary_engine.stats().running == 1)
        await conn.disconnect()
    [record] = lines(access)
    assert (fields(record)["rid"], fields(record)["status"]) == ("gone2", 499)


async def test_requests_refused_at_the_door_are_logged(
    tributary_client: AppClient, access: pytest.LogCaptureFixture
) -> None:
    bad = await tributary_client.post("/generate", {"text": "hi", "sampling_params": {"top_p": 9}})
    assert bad.status == 400
    assert (await tributary_client.get("/health")).status == 200  # not a request: no line
    [record] = lines(access)
    assert fields(record)["rid"] is None and fields(record)["status"] == 400
