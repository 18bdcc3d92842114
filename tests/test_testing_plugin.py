"""The contracts of `tributary.testing`, the pytest plugin (loaded here, as for any user, by
its `pytest11` entry point): configs from markers and parameters, the idle checks, leaving
streams, failed steps, the in-memory client and disconnects over real sockets.
docs/testing.md shows the same fixtures from a user's side (tests/test_docs_testing.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tributary import engine
from tributary.engine import Done, Error, Frame, GenerateRequest, SamplingParams, SimLatency
from tributary.testing import (
    DEFAULT_SIM_LATENCY,
    AppClient,
    RunningServer,
    SSEParser,
    assert_engine_idle,
    collect,
    disconnect_after,
    fail_step,
    leave_stream_after,
    open_sim_engine,
    sim_config,
    step_time,
    wait_engine_idle,
)

pytestmark = pytest.mark.tributary_config(max_running_requests=3)


def request(max_new_tokens: int, text: str = "hello") -> GenerateRequest:
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": max_new_tokens})
    return GenerateRequest(text=text, sampling=params)


def long_stream(tokens: int = 1000) -> dict[str, Any]:
    return {"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": tokens}}


# -- configs ----------------------------------------------------------------------------------


async def test_the_default_engine_is_a_sim_engine(tributary_engine: engine.Engine) -> None:
    config = tributary_engine.config
    assert config.runner == "sim" and config.sim_latency == DEFAULT_SIM_LATENCY
    assert config.context_length == 4096
    assert config.max_running_requests == 3  # the module's marker


class TestMarkers:
    pytestmark = pytest.mark.tributary_config(max_running_requests=2, stream_interval=2)

    async def test_the_class_marker_wins_over_the_module(
        self, tributary_engine: engine.Engine
    ) -> None:
        assert tributary_engine.config.max_running_requests == 2

    @pytest.mark.tributary_config(stream_interval=5)
    async def test_the_test_marker_wins_over_the_class(
        self, tributary_engine: engine.Engine
    ) -> None:
        assert tributary_engine.config.stream_interval == 5
        assert tributary_engine.config.max_running_requests == 2


@pytest.mark.parametrize(
    "tributary_engine_config",
    [{"max_queued_requests": 7}, engine.EngineConfig(runner="sim", max_queued_requests=9)],
    indirect=True,
)
async def test_indirect_parameters(
    tributary_engine_config: engine.EngineConfig, tributary_engine: engine.Engine
) -> None:
    assert tributary_engine.config.max_queued_requests in (7, 9)
    # The marker applies on top of whatever the config fixture gives.
    assert tributary_engine.config.max_running_requests == 3
    assert tributary_engine_config.max_running_requests == 8


class TestAnOverriddenConfigKeepsItsParameters:
    """An override of `tributary_engine_config` that never reads `request.param`: the
    indirect parameter still reaches the engine (`tributary_engine` applies it)."""

    @pytest.fixture
    def tributary_engine_config(self) -> engine.EngineConfig:
        return sim_config(stream_interval=3, max_queued_requests=11)

    @pytest.mark.parametrize(
        "tributary_engine_config",
        [{"max_queued_requests": 5}, engine.EngineConfig(runner="sim", max_queued_requests=6)],
        indirect=True,
        ids=["dict", "config"],
    )
    async def test_the_parameter_is_applied(
        self, tributary_engine: engine.Engine, request: pytest.FixtureRequest
    ) -> None:
        config = tributary_engine.config
        assert config.max_queued_requests == (5 if "dict" in request.node.name else 6)
        # A dict replaces fields of the override's config; an EngineConfig replaces it all.
        assert config.stream_interval == (3 if "dict" in request.node.name else 1)
        assert config.max_running_requests == 3  # and the module's marker still applies


# -- the idle checks ------------------------------------------------------------------------


async def test_idle_report_names_what_is_held(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    assert tributary_engine.idle_report().idle
    assert_engine_idle(tributary_engine)
    stream = tributary_engine.submit(GenerateRequest(text="hello", rid="held"))
    await stream.__anext__()
    report = tributary_engine.idle_report()
    assert report.running == 1 and report.slots_held == 1 and report.rids == ("held",)
    assert report.kv_used_cells == len("hello") and report.scheduler_alive
    with pytest.raises(AssertionError, match=r"running=1, kv_used_cells=5, slots_held=1"):
        assert_engine_idle(tributary_engine)
    stream.close()
    assert tributary_engine.idle_report().rids == ()  # free at once ...
    assert tributary_engine.idle_report().running == 1  # ... the slot at the step boundary


class _SchedulerDeath(BaseException):
    """Not an Exception, so the scheduler does not treat it as a failed step: it dies."""


async def test_a_dead_or_closed_scheduler_is_not_idle(autojump_clock: trio.abc.Clock) -> None:
    async def die(plan: Any) -> list[int]:
        raise _SchedulerDeath

    with pytest.raises(_SchedulerDeath):
        async with open_sim_engine() as eng:
            assert_engine_idle(eng)
            eng._runner.step = die  # type: ignore[method-assign]
            eng.submit(request(5)).close()  # wakes the scheduler, whose step now kills it
            eng.submit(request(5))
            with trio.CancelScope(shield=True):  # the dead scheduler cancels this block
                await trio.testing.wait_all_tasks_blocked()
                report = eng.idle_report()
                # Its shutdown ended every request: only the dead scheduler is left.
                assert not report.scheduler_alive
                assert (report.running, report.waiting, report.rids) == (0, 0, ())
                with pytest.raises(AssertionError, match="scheduler_alive=False"):
                    assert_engine_idle(eng)
                with pytest.raises(AssertionError, match="cannot become idle"):
                    await wait_engine_idle(eng)
    assert not eng.idle_report().idle
    async with open_sim_engine() as eng:
        assert_engine_idle(eng)
    with pytest.raises(AssertionError, match="closed or its scheduler died"):
        assert_engine_idle(eng)


async def test_wait_engine_idle_bound_is_exact_in_virtual_time(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    # Leaving after a frame: the scheduler is already inside the next decode step, and the
    # sequence leaves when that step ends, exactly one step later.
    await leave_stream_after(tributary_engine.submit(request(100)), 3)
    left = trio.current_time()
    await wait_engine_idle(tributary_engine, timeout=step_time(decoding=1))
    assert trio.current_time() - left == pytest.approx(step_time(decoding=1))
    await leave_stream_after(tributary_engine.submit(request(100)), 3)
    with pytest.raises(AssertionError, match="still not idle after"):
        await wait_engine_idle(tributary_engine, timeout=step_time(decoding=1) / 2)


async def test_leaving_a_stream_that_ends_first_is_an_error(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    with pytest.raises(AssertionError, match="ended after 2 items"):
        await leave_stream_after(tributary_engine.submit(request(2)), 5)
    assert_engine_idle(tributary_engine)
    assert await leave_stream_after(tributary_engine.submit(request(2)), 0) == []
    await wait_engine_idle(tributary_engine)


# -- failures ------------------------------------------------------------------------------


@pytest.mark.tributary_config(sim_fail_at_step=2)
async def test_the_configured_step_fails(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    items = await collect(tributary_engine.submit(request(10)))
    assert [type(i) for i in items] == [Frame, Error]
    assert_engine_idle(tributary_engine)
    assert isinstance((await collect(tributary_engine.submit(request(3))))[-1], Done)


async def test_fail_step_fails_the_next_step_or_the_one_named(
    tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    assert fail_step(tributary_engine) == 1
    items = await collect(tributary_engine.submit(request(10)))
    assert [type(i) for i in items] == [Error]
    assert fail_step(tributary_engine, at=4) == 4  # steps 2 and 3 run, step 4 fails
    items = await collect(tributary_engine.submit(request(10)))
    assert [type(i) for i in items] == [Frame, Frame, Error]
    with pytest.raises(ValueError, match="already started"):
        fail_step(tributary_engine, at=2)


async def test_fail_step_needs_the_sim_runner() -> None:
    class NotSim:
        _runner = object()

    with pytest.raises(TypeError, match="sim runner"):
        fail_step(NotSim())  # type: ignore[arg-type]


# -- HTTP ---------------------------------------------------------------------------------


def test_sse_parser_takes_events_however_chunks_split_them() -> None:
    parser = SSEParser()
    assert parser.feed(b'data: {"a"') == []
    assert parser.feed(b": 1}\n\ndata: [DONE]\n\n: comment\n\ndata: plain") == [{"a": 1}, "[DONE]"]
    assert parser.feed("\r\n\r\n") == ["plain"]


async def test_in_memory_requests_and_streams(
    tributary_client: AppClient, tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    health = await tributary_client.get("/health")
    assert health.status == 200
    reply = await tributary_client.post("/generate", long_stream(40))  # > 10 chunks, unread
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = reply.events()
    assert events[-1] == "[DONE]" and len(events) == 41
    async with tributary_client.stream("POST", "/generate", json=long_stream(3)) as s:
        assert await s.start() == 200
        streamed = [event async for event in s]
    assert streamed[-1] == "[DONE]" and s.complete and not s.disconnected
    bad = await tributary_client.post("/generate", {"text": "x", "sampling_params": {"n": 0}})
    assert bad.status == 400
    assert_engine_idle(tributary_engine)


async def test_in_memory_disconnects(
    tributary_client: AppClient, tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    events = await tributary_client.disconnect_after("/generate", long_stream(), frames=2)
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 2]
    await wait_engine_idle(tributary_engine, timeout=step_time(decoding=1))
    start = trio.current_time()
    unary = {"text": "hello", "sampling_params": {"max_new_tokens": 1000}}
    assert (
        await tributary_client.disconnect_after("/generate", unary, seconds=0.25, unary=True) == []
    )
    assert trio.current_time() - start == pytest.approx(0.25)
    await wait_engine_idle(tributary_engine, timeout=step_time(decoding=1))
    # Leaving before the response has started cuts nothing that was checked: an error.
    with pytest.raises(AssertionError, match=r"had not started .*no response headers"):
        await tributary_client.disconnect_after("/generate", unary, seconds=0.25)
    await wait_engine_idle(tributary_engine)

    async def slow_to_read(scope: Any, receive: Any, send: Any) -> None:
        await trio.sleep(1)  # the handler has not even read the request at 0.25 s
        await receive()

    with pytest.raises(AssertionError, match=r"had not started .*had not read the request"):
        await AppClient(slow_to_read).disconnect_after("/x", unary, seconds=0.25, unary=True)
    # A response that ends before the moment to leave cut nothing: that is an error.
    with pytest.raises(AssertionError, match="ended before the client left"):
        await tributary_client.disconnect_after("/generate", long_stream(2), frames=5)
    with pytest.raises(TypeError, match="say when"):
        await tributary_client.disconnect_after("/generate", unary)


async def test_leaving_the_stream_block_disconnects(
    tributary_app: Any, tributary_engine: engine.Engine, autojump_clock: trio.abc.Clock
) -> None:
    client = AppClient(tributary_app)
    with trio.move_on_after(0.05):  # cancelled mid-stream: the exchange ends with it
        async with client.stream("POST", "/generate", json=long_stream()) as s:
            async for _ in s:
                pass
    assert not s.complete
    await wait_engine_idle(tributary_engine, timeout=step_time(decoding=1))


async def test_a_real_server_and_real_disconnects(
    tributary_server: RunningServer, tributary_http_client: httpx.AsyncClient
) -> None:
    eng = tributary_server.engine
    reply = await tributary_http_client.post("/generate", json=long_stream(3))
    assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n")
    url = tributary_server.url + "/generate"
    events = await disconnect_after(url, long_stream(), frames=2)
    assert len(events) >= 2 and "[DONE]" not in events
    await wait_engine_idle(eng, timeout=2.0)
    unary = {"text": "hello", "sampling_params": {"max_new_tokens": 1000}}
    assert await disconnect_after(url, unary, seconds=0.1, unary=True) == []
    await wait_engine_idle(eng, timeout=2.0)
    with pytest.raises(AssertionError, match=r"had not started .*no response headers"):
        await disconnect_after(url, unary, seconds=0.1)
    await wait_engine_idle(eng, timeout=2.0)
    with pytest.raises(AssertionError, match="ended before the client left"):
        await disconnect_after(url, long_stream(1), frames=3)


async def test_open_sim_engine_without_fixtures(autojump_clock: trio.abc.Clock) -> None:
    slow = SimLatency(step_base=1.0, decode_per_seq=0.0, prefill_per_token=0.0)
    async with open_sim_engine(sim_latency=slow, max_running_requests=1) as eng:
        assert eng.config.max_running_requests == 1
        start = trio.current_time()
        await collect(eng.submit(request(3)))
        assert trio.current_time() - start == pytest.approx(3.0)


def test_a_real_server_refuses_virtual_time(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\ntrio_mode = true\n")
    (tmp_path / "test_clock.py").write_text(
        "async def test_it(tributary_server, autojump_clock):\n    pass\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout
    assert "cannot run under autojump_clock" in done.stdout


async def test_a_grammar_on_a_runner_without_one_names_that_runner(
    tributary_engine: engine.Engine,
) -> None:
    params = SamplingParams.from_dict({"regex": "a+"})
    with pytest.raises(engine.BadRequest, match=r"runner \(SimRunner\) cannot constrain"):
        tributary_engine.submit(GenerateRequest(text="hi", sampling=params))


def test_garbage_cycles_counts_what_only_the_collector_frees() -> None:
    import gc
    from collections import Counter

    from tributary import testing
    from tributary.engine.request import EngineStats

    class Holder:  # a cycle through one of Tributary's objects
        pass

    kept = ["the program's own"]
    gc.garbage.append(kept)
    try:
        with testing.garbage_cycles() as cycles:
            holder = Holder()
            holder.stats = EngineStats(  # type: ignore[attr-defined]
                running=0, waiting=0, kv_used_cells=0, kv_total_cells=0, steps=0, generated_tokens=0
            )
            holder.me = [holder, holder.stats]  # type: ignore[attr-defined]
            del holder
            assert cycles() == Counter({"tributary.engine.request.EngineStats": 1})
        with pytest.raises(RuntimeError, match="inside"):
            cycles()
        assert gc.garbage == [kept]  # what was there before is given back
    finally:
        gc.garbage.remove(kept)
