"""The pytest fixtures and hooks of `tributary.testing` (registered through the `pytest11`
entry point, so installing Tributary is enough)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

from tributary.app import ServerSettings, create_app
from tributary.engine import Engine, EngineConfig, open_engine
from tributary.engine.runners.base import Runner

from ._engine import sim_config
from ._http import AppClient, RunningServer, open_server, server_settings

if TYPE_CHECKING:
    import httpx

__all__ = [
    "_tributary_real_clock",
    "pytest_configure",
    "tributary_app",
    "tributary_client",
    "tributary_engine",
    "tributary_engine_config",
    "tributary_http_client",
    "tributary_runner",
    "tributary_server",
    "tributary_server_settings",
]

MARKER = "tributary_config"
CONFIG_FIXTURE = "tributary_engine_config"


def _needs_pytest_trio(func: Callable[..., Any]) -> Callable[..., Any]:
    """Without pytest-trio, an async fixture fails its test with instructions instead of
    leaving pytest to complain about an unawaited coroutine."""

    @functools.wraps(func)
    def fail(*args: Any, **kwargs: Any) -> Any:
        pytest.fail(
            f"the {func.__name__} fixture (tributary.testing) needs pytest-trio: "
            "pip install pytest-trio, then set `trio_mode = true` under "
            "[tool.pytest.ini_options] or mark the test @pytest.mark.trio",
            pytrace=False,
        )

    return fail


def _fixture_needing_pytest_trio(func: Callable[..., Any]) -> Any:
    return pytest.fixture(_needs_pytest_trio(func))


try:
    from pytest_trio import trio_fixture as _trio_fixture  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - exercised only without pytest-trio
    _trio_fixture = _fixture_needing_pytest_trio


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(**fields): EngineConfig fields that tributary_engine replaces in "
        "tributary_engine_config for this test, class or module (e.g. sim_fail_at_step=3)",
    )


_NO_PARAM = object()


def _indirect_param(node: pytest.Item) -> Any:
    """The value `tributary_engine_config` is parametrized with (indirectly) for this test,
    read from the test's call spec so that it does not depend on which fixture function
    (the plugin's or an override that ignores `request.param`) provides the config."""
    callspec = getattr(node, "callspec", None)
    if callspec is None:
        return _NO_PARAM
    return callspec.params.get(CONFIG_FIXTURE, _NO_PARAM)


def _apply_param(config: EngineConfig, param: Any) -> EngineConfig:
    """An `EngineConfig` param replaces `config`; a dict of fields replaces those fields."""
    if param is _NO_PARAM:
        return config
    if isinstance(param, EngineConfig):
        return param
    if isinstance(param, Mapping):
        return dataclasses.replace(config, **param)
    raise TypeError(f"{CONFIG_FIXTURE} takes an EngineConfig or a dict of fields, not {param!r}")


@pytest.fixture
def tributary_engine_config(request: pytest.FixtureRequest) -> EngineConfig:
    """The config `tributary_engine` is opened with: `sim_config()` (the sim runner,
    `DEFAULT_SIM_LATENCY`, a 4096-token context).

    Change it by overriding this fixture (in a test module or conftest.py), or by indirect
    parametrization with an `EngineConfig` (used as is), or a dict of fields (replaced in
    the config this fixture, or your override of it, returns)::

        @pytest.mark.parametrize(
            "tributary_engine_config", [{"max_running_requests": 1}], indirect=True
        )

    `tributary_engine` applies the parameter itself, so an override of this fixture need
    not read `request.param` for it to count. For a few fields, the `tributary_config`
    marker is shorter (see `tributary_engine`).
    """
    return _apply_param(sim_config(), _indirect_param(request.node))


def _marked_overrides(node: pytest.Item) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for marker in reversed(list(node.iter_markers(MARKER))):  # module, class, then function
        if marker.args:
            raise TypeError(f"@pytest.mark.{MARKER} takes EngineConfig fields as keywords")
        overrides.update(marker.kwargs)
    return overrides


@pytest.fixture
def tributary_runner() -> Runner | None:
    """A runner for `tributary_engine` to drive instead of the one the config names (None:
    the config's). Override it to test a runner of your own under the same fixtures; the
    engine closes it at the end of the test (see docs/runners.md)."""
    return None


@_trio_fixture
async def tributary_engine(
    request: pytest.FixtureRequest,
    tributary_engine_config: EngineConfig,
    tributary_runner: Runner | None,
) -> AsyncIterator[Engine]:
    """An open engine for the test, closed after it (requests still in flight then end
    with a 503 abort).

    Its config is `tributary_engine_config`, then the test's indirect parameter of
    `tributary_engine_config` if it has one (an `EngineConfig` replaces the config, a dict
    replaces those fields; applied here, so an override of the config fixture cannot drop
    it), then the fields of any `@pytest.mark.tributary_config(**fields)` marker (the
    test's marker wins over its class's, which wins over the module's `pytestmark`)::

        @pytest.mark.tributary_config(sim_fail_at_step=3, max_running_requests=1)
        async def test_a_failed_step(tributary_engine, autojump_clock): ...

    `engine.config` is the config actually used. On the sim runner every step sleeps on
    Trio's clock, so a test that asks for pytest-trio's `autojump_clock` (the test itself
    must ask for it) runs in virtual time with exact latencies (`step_time`).
    """
    config = _apply_param(tributary_engine_config, _indirect_param(request.node))
    overrides = _marked_overrides(request.node)
    if overrides:
        config = dataclasses.replace(config, **overrides)
    async with open_engine(config, runner=tributary_runner) as engine:
        yield engine


@pytest.fixture
def tributary_server_settings() -> ServerSettings:
    """Settings for `tributary_app` and `tributary_server`: `server_settings()` (port 0, a 1 s
    graceful shutdown). Override it to change them."""
    return server_settings()


@pytest.fixture
def tributary_app(tributary_engine: Engine, tributary_server_settings: ServerSettings) -> Any:
    """Tributary's HTTP app (`create_app`) over `tributary_engine`: SGLang's and OpenAI's
    APIs, with no server."""
    return create_app(tributary_engine, tributary_server_settings)


@pytest.fixture
def tributary_client(tributary_app: Any) -> AppClient:
    """An in-memory client for `tributary_app` (`AppClient`): no socket, so it runs on the
    test's clock, virtual time included."""
    return AppClient(tributary_app)


@pytest.fixture
def _tributary_real_clock(request: pytest.FixtureRequest) -> None:
    """Fails, before anything starts, a test that asks for a real server and a mock clock."""
    clocks = [name for name in request.fixturenames if name in ("autojump_clock", "mock_clock")]
    if clocks:
        pytest.fail(
            f"tributary_server runs a real server on real sockets; it cannot run under "
            f"{clocks[0]} (use tributary_client for virtual time)",
            pytrace=False,
        )


@_trio_fixture
async def tributary_server(
    _tributary_real_clock: None,
    tributary_engine: Engine,
    tributary_server_settings: ServerSettings,
) -> AsyncIterator[RunningServer]:
    """A real Hypercorn serving `tributary_engine` on a free port of 127.0.0.1
    (`RunningServer`: `.engine`, `.url`), shut down gracefully after the test.

    Real sockets and Hypercorn's timers run on Trio's clock: a test using this fixture must
    not ask for `autojump_clock` (it fails at once if it does).
    """
    if isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock):
        raise RuntimeError(
            "tributary_server runs a real server on real sockets; it cannot run under a "
            "MockClock (use tributary_client for virtual time)"
        )
    async with open_server(engine=tributary_engine, settings=tributary_server_settings) as s:
        yield s


@_trio_fixture
async def tributary_http_client(
    tributary_server: RunningServer,
) -> AsyncIterator[httpx.AsyncClient]:
    """An `httpx.AsyncClient` whose base URL is `tributary_server`'s (needs httpx)."""
    import httpx

    async with httpx.AsyncClient(base_url=tributary_server.url, timeout=30) as client:
        yield client
