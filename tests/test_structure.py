"""The shape of the code, checked: rooms a newcomer can read and a dependency graph that
runs one way.

- no product module over 500 lines;
- no import cycle between Tributary's modules, counting imports under `if TYPE_CHECKING:`
  (a cycle there is coupling all the same) and imports inside functions;
- the API packages, `app/sglang`, `app/openai` and `app/anthropic`, never import each other;
  they build on app/'s shared packages (`app/http`: plumbing; `app/observe`: timing, access log,
  metrics; and the others beside them), which import no API package.

The graph is read from the source with `ast`, so it sees what `import` statements say, not
what happens to be loaded in this process.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Source folder -> the module prefix it is installed under (pyproject's package-dir).
SOURCES = {"app": "tributary.app", "engine": "tributary.engine", "tributary": "tributary"}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for folder, prefix in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([prefix, *parts])] = path
    return modules


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> set[str]:
    """The Tributary modules `name` imports, anywhere in its body."""
    path = MODULES[name]
    package = name if _is_package(name) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
            found.update(t for t in targets if t in MODULES)
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base_parts = package.split(".")
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if base not in MODULES:
            continue
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            # `from package import module` names the module; anything else, the package.
            found.add(sub if sub in MODULES else base)
    found.discard(name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(GRAPH[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return components


def test_no_import_cycles() -> None:
    cycles = _cycles()
    assert not cycles, "import cycles:\n" + "\n".join(
        " <-> ".join(c) + "\n    " + "; ".join(f"{m} -> {sorted(GRAPH[m] & set(c))}" for m in c)
        for c in cycles
    )


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_a_room_not_a_hall(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)} has {lines} lines"


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


API_PACKAGES = ("tributary.app.sglang", "tributary.app.openai", "tributary.app.anthropic")
#: app/'s shared packages (plumbing, observability, what the APIs build on): everything in
#: app/ but the APIs and the top-level modules that compose them (routes, openapi, cli).
SHARED_PACKAGES = sorted(
    {
        ".".join(m.split(".")[:3])
        for m in MODULES
        if m.startswith("tributary.app.") and _is_package(".".join(m.split(".")[:3]))
    }
    - set(API_PACKAGES)
)


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        *((api, tuple(other for other in API_PACKAGES if other != api)) for api in API_PACKAGES),
        *((shared, API_PACKAGES) for shared in SHARED_PACKAGES),
    ],
)
def test_api_packages_stand_apart(package: str, forbidden: tuple[str, ...]) -> None:
    members = [m for m in MODULES if _under(m, package)]
    assert members, f"{package} does not exist"
    wrong = sorted(
        f"{m} imports {t}"
        for m in members
        for t in GRAPH[m]
        if any(_under(t, f) for f in forbidden)
    )
    assert not wrong, "\n".join(wrong)


def test_the_shared_packages_exist() -> None:
    """The plumbing and observability packages both APIs build on are where the layout
    says (a rename would silently drop them from the check above)."""
    assert {"tributary.app.http", "tributary.app.observe"} <= set(SHARED_PACKAGES)
