"""Every module of `app` and `engine` imports, so a moved or renamed name fails here."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import app
import engine


def all_modules() -> list[str]:
    names = []
    for package in (app, engine):
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
    """`app` never imports llama_cpp; `engine` never imports quart or hypercorn."""
    import ast
    from pathlib import Path

    for package, banned in ((app, ("llama_cpp",)), (engine, ("quart", "quart_trio", "hypercorn"))):
        for path in Path(package.__path__[0]).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    roots = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    roots = [node.module.split(".")[0]]
                else:
                    continue
                assert not set(roots) & set(banned), f"{path} imports {roots}"
