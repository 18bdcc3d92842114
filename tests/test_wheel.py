"""The wheel, installed for real: built with `python -m build --wheel`, installed (not editable)
into a fresh venv, and used from a user's project that has its own `app.py` and `engine/`
package. From that project's directory: the embedding example of docs/embedding.md,
`tributary serve --port 0` (one /generate, then SIGINT), and a test module using the pytest
plugin, all with the user's `app` and `engine` still importing as theirs.

Slow (a build, a venv, an install from pip's index and cache, and the real model): marked
`model`. The phases' durations are printed (`pytest -s` shows them).
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
EMBEDDING = (ROOT / "docs" / "embedding.md").read_text()
HTTP_EXAMPLE = next(
    block
    for block in re.findall(r"```python\n(.*?)```", EMBEDDING, flags=re.DOTALL)
    if "/generate" in block
)

pytestmark = pytest.mark.model

#: Left out of the copy the wheel is built from: environments, caches, build output.
NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    ".lint",
    ".bench-peers",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
)

USER_APP = '''"""The user's own Flask-style app module: it must win the name `app`."""
WHO = "the user's app"
'''
USER_ENGINE = '''"""The user's own engine package: it must win the name `engine`."""
WHO = "the user's engine"
'''
CHECK_USER_MODULES = """\
import app
import engine

assert app.WHO == "the user's app", app.__file__
assert engine.WHO == "the user's engine", engine.__file__
"""
REPORT_MODULES = """
import sys

import tributary.app
import tributary.engine

assert sys.modules["app"] is app and sys.modules["engine"] is engine
print("user app:", app.__file__)
print("tributary:", tributary.__file__)
"""
USER_TEST = """\
import app
import engine

from tributary.testing import assert_engine_idle


async def test_the_plugin_works_beside_the_users_modules(
    tributary_client, tributary_engine, autojump_clock
):
    assert app.WHO == "the user's app" and engine.WHO == "the user's engine"
    reply = await tributary_client.post(
        "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}}
    )
    assert reply.status == 200 and reply.json()["meta_info"]["completion_tokens"] == 3
    assert_engine_idle(tributary_engine)
"""


class Clock:
    """Times the phases and prints them."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)


class _Phase:
    def __init__(self, clock: Clock, name: str) -> None:
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        self.start = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self.clock.times[self.name] = elapsed = time.monotonic() - self.start
        print(f"{self.name}: {elapsed:.1f} s", flush=True)


def run(args: list[str | Path], *, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{args}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def user_env() -> dict[str, str]:
    """The caller's environment without anything that would reach the repository's code."""
    drop = {"PYTHONPATH", "VIRTUAL_ENV", "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_ADDOPTS"}
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A copy of the working tree to build from (the build writes into its source tree)."""
    pytest.importorskip("build")
    copy = tmp_path / "source"
    shutil.copytree(ROOT, copy, ignore=NOT_SOURCE, symlinks=True)
    return copy


def test_the_wheel_serves_a_user_project_with_its_own_app_and_engine(
    source: Path, tmp_path: Path
) -> None:
    clock = Clock()
    dist = tmp_path / "dist"
    with clock.phase("build the wheel"):
        build = [sys.executable, "-m", "build", "--wheel", "--outdir", dist, source]
        run(build, cwd=source, timeout=600)
    (built,) = dist.glob("tributary-*.whl")

    # Installed, Tributary claims one top-level name, and registers its pytest plugin.
    names = zipfile.ZipFile(built).namelist()
    assert {name.split("/")[0] for name in names} == {
        "tributary",
        built.name.split("-py3")[0] + ".dist-info",
    }
    assert "tributary/testing/__init__.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(built).read(entry_points).decode()
    assert "[pytest11]\ntributary = tributary.testing" in text

    venv = tmp_path / "venv"
    with clock.phase("create the venv"):
        run([sys.executable, "-m", "venv", venv], cwd=tmp_path, timeout=120)
    python = venv / "bin" / "python"
    with clock.phase("pip install the wheel"):
        run([python, "-m", "pip", "install", "-q", f"{built}[testing]"], cwd=tmp_path, timeout=900)

    project = tmp_path / "project"
    (project / "engine").mkdir(parents=True)
    (project / "app.py").write_text(USER_APP)
    (project / "engine" / "__init__.py").write_text(USER_ENGINE)

    # Nothing but `tributary` landed in site-packages under our names.
    run(
        [
            python,
            "-c",
            "import importlib.util as u; assert not u.find_spec('app'), 'app'; "
            "assert not u.find_spec('engine'), 'engine'",
        ],
        cwd=tmp_path,
        timeout=60,
    )

    with clock.phase("the embedding example"):
        script = project / "embedding_example.py"
        script.write_text(CHECK_USER_MODULES + HTTP_EXAMPLE + REPORT_MODULES)
        done = run([python, script], cwd=project, timeout=300)
    *example, user_app, package = done.stdout.strip().splitlines()
    generated, latency = "\n".join(example).rsplit(" ", 1)  # the text may hold newlines
    assert generated.strip() and float(latency) > 0
    assert user_app == f"user app: {project / 'app.py'}"
    assert package.startswith(f"tributary: {venv}/lib/"), package

    with clock.phase("tributary serve, one /generate, SIGINT"):
        serve_once(venv / "bin" / "tributary", project, tmp_path / "serve.log")

    with clock.phase("the pytest plugin"):
        (project / "pyproject.toml").write_text("[tool.pytest.ini_options]\ntrio_mode = true\n")
        (project / "test_user.py").write_text(USER_TEST)
        done = run(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project, timeout=300
        )
    assert "1 passed" in done.stdout, done.stdout[-2000:]
    print("total:", f"{sum(clock.times.values()):.1f} s")


def serve_once(tributary: Path, project: Path, log: Path) -> None:
    """`tributary serve --port 0` from the project: wait for its "Tributary serving" line,
    generate once, then SIGINT; it must exit 0."""
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [tributary, "serve", "--port", "0", "--context-length", "2048"],
            cwd=project,
            env=user_env(),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        try:
            url = wait_for_url(proc, deadline=time.monotonic() + 180)
            reply = httpx.post(
                f"{url}/generate",
                json={
                    "text": "The capital of France is",
                    "sampling_params": {"temperature": 0, "max_new_tokens": 8},
                },
                timeout=60,
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["meta_info"]["completion_tokens"] == 8
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def wait_for_url(proc: subprocess.Popen[str], deadline: float) -> str:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            match = re.match(r"Tributary serving .* at (http://\S+)$", line.strip())
            if match:
                return match.group(1)
    raise AssertionError(f"no 'Tributary serving' line (exit status {proc.poll()})")
