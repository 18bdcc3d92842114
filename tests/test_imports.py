"""Every module of `tributary` imports, so a moved or renamed name fails here; and the
installed project claims no top-level name but `tributary`."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import tributary
from tributary import app, engine, testing


def all_modules() -> list[str]:
    names = ["tributary"]  # not tributary.__main__: importing it runs the CLI
    for package in (app, engine, testing):
        names.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
            names.append(info.name)
    return names


@pytest.mark.parametrize("name", all_modules())
def test_module_imports(name: str) -> None:
    module = importlib.import_module(name)
    for public in getattr(module, "__all__", []):
        assert hasattr(module, public), f"{name}.__all__ names missing {public}"


def test_layering() -> None:
    """`app` never imports llama_cpp; `engine` never imports quart, hypercorn or the app."""
    import ast
    from pathlib import Path

    layers = (
        (app, ("llama_cpp",)),
        (engine, ("quart", "quart_trio", "hypercorn", "tributary.app")),
    )
    for package, banned in layers:
        for path in Path(package.__path__[0]).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    assert not any(module == b or module.startswith(b + ".") for b in banned), (
                        f"{path} imports {module}"
                    )


def test_python_m_tributary() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tributary", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout


def test_only_the_tributary_name_is_claimed(tmp_path: object) -> None:
    """A user's own `app` and `engine` modules must win: importing all of Tributary from
    outside the repository binds neither name."""
    code = (
        "import sys, tributary, tributary.app.cli, tributary.engine.runners.llama,"
        " tributary.testing;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('app', 'engine')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert tributary.open_engine is engine.open_engine
