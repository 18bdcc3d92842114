"""`tributary.testing`: fixtures and helpers for cancellation-safety tests of Trio code around
Tributary's engine, on the deterministic sim runner and (under `autojump_clock`) virtual time.

It is a pytest plugin, registered through the `pytest11` entry point: installing Tributary
makes the fixtures available (`-p no:tributary` turns it off; with
PYTEST_DISABLE_PLUGIN_AUTOLOAD set, `-p tributary` turns it on). The async fixtures need
pytest-trio, with `trio_mode = true` in the pytest configuration or `@pytest.mark.trio` on the
tests (`pip install 'tributary[testing]'` brings pytest-trio and httpx). docs/testing.md
shows how to use it.

Fixtures (function scope; the chain is config -> engine -> app -> client, engine -> server):

- `tributary_engine_config`: the config, `sim_config()` unless overridden; an indirect
  parameter of it (a dict of fields or an `EngineConfig`) is applied by `tributary_engine`,
  override or not; `@pytest.mark.tributary_config(**fields)` replaces fields for a test,
  class or module;
- `tributary_runner`: None, or a runner of your own for the engine to drive;
- `tributary_engine`: an open `Engine` on that config, closed after the test;
- `tributary_server_settings`, `tributary_app` (the HTTP app over the engine),
  `tributary_client` (an in-memory `AppClient` for it: any clock, virtual time included);
- `tributary_server` (a real Hypercorn on a free port: `.engine`, `.url`; real clock only)
  and `tributary_http_client` (an httpx client for it).

Helpers (plain functions and classes that need no fixture and work in any Trio code; importing
`tributary.testing` imports pytest):

- `sim_config`, `open_sim_engine`, `step_time`, `DEFAULT_SIM_LATENCY`: sim engines and the
  exact cost of their steps;
- `assert_engine_idle(engine)` and `await wait_engine_idle(engine)`: nothing running or
  waiting, no KV cell used, no slot or rid held, and the scheduler task still running;
- `leave_stream_after(stream, frames)`: a consumer that stops reading mid-generation;
  `collect(stream)`: read a stream to its end;
- `fail_step(engine, at=None)`: the sim runner's next (or `at`-th) step fails;
  `sim_config(sim_fail_at_step=N)` fails step N from the start;
- `garbage_cycles()`: counts the Tributary objects a block leaves to the cycle collector;
- `AppClient` (in-memory HTTP, with `disconnect_after(path, json, frames=, seconds=)`),
  `open_server`, `server_settings`, `disconnect_after(url, json, frames=, seconds=)` (a
  real socket closed mid-response), `parse_sse`.
"""

from tributary.engine.load import IdleReport as IdleReport

from ._engine import DEFAULT_SIM_LATENCY as DEFAULT_SIM_LATENCY
from ._engine import assert_engine_idle as assert_engine_idle
from ._engine import collect as collect
from ._engine import fail_step as fail_step
from ._engine import garbage_cycles as garbage_cycles
from ._engine import leave_stream_after as leave_stream_after
from ._engine import open_sim_engine as open_sim_engine
from ._engine import sim_config as sim_config
from ._engine import step_time as step_time
from ._engine import wait_engine_idle as wait_engine_idle
from ._http import AppClient as AppClient
from ._http import AppResponse as AppResponse
from ._http import AppStream as AppStream
from ._http import RunningServer as RunningServer
from ._http import SSEParser as SSEParser
from ._http import disconnect_after as disconnect_after
from ._http import open_server as open_server
from ._http import parse_sse as parse_sse
from ._http import server_settings as server_settings

# The plugin: pytest finds fixtures and hooks among this module's names.
from ._plugin import _tributary_real_clock as _tributary_real_clock
from ._plugin import pytest_configure as pytest_configure
from ._plugin import tributary_app as tributary_app
from ._plugin import tributary_client as tributary_client
from ._plugin import tributary_engine as tributary_engine
from ._plugin import tributary_engine_config as tributary_engine_config
from ._plugin import tributary_http_client as tributary_http_client
from ._plugin import tributary_runner as tributary_runner
from ._plugin import tributary_server as tributary_server
from ._plugin import tributary_server_settings as tributary_server_settings

__all__ = [
    "DEFAULT_SIM_LATENCY",
    "AppClient",
    "AppResponse",
    "AppStream",
    "IdleReport",
    "RunningServer",
    "SSEParser",
    "assert_engine_idle",
    "collect",
    "disconnect_after",
    "fail_step",
    "garbage_cycles",
    "leave_stream_after",
    "open_server",
    "open_sim_engine",
    "parse_sse",
    "server_settings",
    "sim_config",
    "step_time",
    "wait_engine_idle",
]
