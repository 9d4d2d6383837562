"""The floor plan, read from the code's own imports (ARCHITECTURE.md says why it is so).

Promise: ``tables`` (the ground floor) imports no other Headwater package; the components
``capture``, ``streams``, ``analytics`` and ``registry`` import only the ground floor and
themselves; only the roof (``headwater``, ``bench``) imports components; no module imports the
roof; and no two modules import each other, directly or round a longer circle. Imports inside
functions count as much as those at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GROUND = "tables"
COMPONENTS = ("capture", "streams", "analytics", "registry")
ROOF = ("headwater", "bench")
PACKAGES = (GROUND, *COMPONENTS, *ROOF)

pytestmark = pytest.mark.unit


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every Headwater module ``path`` imports (``from pkg import mod`` names the module when it is one)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
            modules = [name for name in names if _exists(name)]
            found.update(modules)
            if len(modules) < len(names):  # names defined in the module itself
                found.add(node.module)
    return {name for name in found if name.split(".")[0] in PACKAGES and _exists(name)}


def _exists(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    return {name: imports_of(path) - {name} for name, path in modules.items()}


GRAPH = graph()


def package(module: str) -> str:
    return module.split(".")[0]


def allowed(importer: str, imported: str) -> bool:
    mine, theirs = package(importer), package(imported)
    if mine == theirs or theirs == GROUND:
        return True
    return mine in ROOF and theirs in (*COMPONENTS, "headwater")


def test_the_graph_is_read() -> None:
    """Guards the guard: the reader sees the imports this layout is known to have."""
    assert "tables.errors" in GRAPH["capture.errors"]
    assert any(package(m) == "streams" for m in GRAPH["headwater.demo"])
    assert len(GRAPH) > 60


@pytest.mark.parametrize("importer", sorted(GRAPH))
def test_no_import_runs_up_a_floor_or_across(importer: str) -> None:
    wrong = sorted(m for m in GRAPH[importer] if not allowed(importer, m))
    assert not wrong, f"{importer} imports {wrong}: see ARCHITECTURE.md for where such code goes"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return out


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_circles() -> None:
    assert cycles(GRAPH) == []


def test_no_package_circles() -> None:
    packages = {p: {package(m) for name, ms in GRAPH.items() if package(name) == p for m in ms} - {p} for p in PACKAGES}
    assert cycles(packages) == []


def test_the_rules_refuse_what_they_should() -> None:
    assert not allowed("streams.writer", "capture.encoder")  # across
    assert not allowed("tables.views", "headwater.stack")  # up from the ground floor
    assert not allowed("capture.agent", "headwater.cli")  # up to the roof
    assert allowed("headwater.demo", "streams.config") and allowed("capture.agent", "tables.wire")


HOST = ("faust", "mode", "aiokafka", "aiohttp", "yarl")  # the Faust app's world
HOSTS = frozenset({"streams", "streams.host", "streams.profile", "streams.endpoint"})  # the adapter (streams.app)


def third_party(path: Path) -> set[str]:
    """The top-level names of every package ``path`` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if package(m) == "streams"))
def test_only_the_host_knows_faust(module: str) -> None:
    """The engine runs without a Faust app: Faust-specific code sits in the host's modules."""
    path = ROOT.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    used = sorted(third_party(path) & set(HOST))
    assert module in HOSTS or not used, f"{module} imports {used}: Faust-specific code belongs in {sorted(HOSTS)}"
    assert not (module not in HOSTS and GRAPH[module] & HOSTS), f"{module} imports the host"
