"""Run the examples of docs/runners.md: the echo runner module is written to a scratch
project, the serving script runs there and prints what the page says it prints, and the test
module runs under pytest with Tributary's plugin (from the installed entry point)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "runners.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A directory holding the page's runner module, as a user's project would."""
    runner, _script, _tests = EXAMPLES
    name = runner.splitlines()[0].removeprefix("# ").strip()
    assert name == "echo_runner.py"
    (tmp_path / name).write_text(runner)
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\ntrio_mode = true\n")
    return tmp_path


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_ADDOPTS")
    }
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_page_has_a_runner_a_server_and_tests() -> None:
    assert len(EXAMPLES) == 3


def test_the_echo_runner_is_served_over_http(project: Path) -> None:
    (project / "serve.py").write_text(EXAMPLES[1])
    done = run(["serve.py"], project)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "'Hello, runner!' {'type': 'stop', 'matched': 0}",
        "'Hello' {'type': 'length', 'length': 5}",
    ]


def test_the_echo_runner_tests_pass(project: Path) -> None:
    (project / "test_echo_runner.py").write_text(EXAMPLES[2])
    done = run(["-m", "pytest", "-q", "-p", "no:cacheprovider"], project)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    defined = len(re.findall(r"^async def test_", EXAMPLES[2], flags=re.MULTILINE))
    assert f"{defined} passed" in done.stdout, done.stdout[-2000:]
