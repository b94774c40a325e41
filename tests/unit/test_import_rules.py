"""The packages' import rules (issue 10), checked on the real import graph.

- ``hora_proto`` (the contract) imports none of the other three packages;
- ``hora_coordinator`` and ``hora_native`` never import ``hora``;
- ``hora`` reaches ``hora_coordinator`` only through ``hora.runner.embedded``,
  and ``hora_negotiation`` (the negotiation table a world of one runs) only
  through ``hora._solo``;
- ``hora_negotiation`` imports neither the service nor the client, nor any
  server or event loop (grpc, asyncio, FastAPI, uvicorn), not even for types;
- ``hora.world``, the framework-neutral API, needs no framework binding, and
  ``hora.torch`` and ``hora.tensorflow`` take it from there;
- no package has an import cycle between its modules, type-only imports
  (``if TYPE_CHECKING:``) included.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PACKAGES = ("hora", "hora_coordinator", "hora_native", "hora_negotiation", "hora_proto")
ENTRY_POINT = "hora.runner.embedded"
SOLO = "hora._solo"


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)


@pytest.fixture(scope="module")
def typed_graph():
    """The graph with the imports made for type checking only, too."""
    return grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)


def _imports(graph, module: str) -> set[str]:
    return set(graph.find_modules_directly_imported_by(module))


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _violations(graph, importers: str, forbidden: set[str], allowed: frozenset[str] = frozenset()
                ) -> list[str]:
    found = []
    for module in sorted(graph.modules):
        if _top(module) != importers or module in allowed:
            continue
        for imported in sorted(_imports(graph, module)):
            if _top(imported) in forbidden:
                found.append(f"{module} imports {imported}")
    return found


def test_the_contract_imports_no_other_package(graph):
    assert _violations(graph, "hora_proto", {"hora", "hora_coordinator", "hora_native"}) == []


def test_the_coordinator_and_the_data_plane_never_import_the_client(graph):
    assert _violations(graph, "hora_coordinator", {"hora"}) == []
    assert _violations(graph, "hora_native", {"hora", "hora_coordinator", "hora_negotiation"}) == []


def test_the_client_reaches_the_coordinator_through_one_entry_point(graph):
    assert ENTRY_POINT in graph.modules
    assert _violations(graph, "hora", {"hora_coordinator"}, frozenset({ENTRY_POINT})) == []


def test_a_world_of_one_takes_the_negotiation_table_without_the_service(graph):
    """``hora._solo`` imports ``hora_negotiation`` itself, not the launcher's door."""
    assert "hora_negotiation.solo" in _imports(graph, SOLO)
    assert ENTRY_POINT not in graph.find_upstream_modules(SOLO)
    assert _violations(graph, "hora", {"hora_negotiation"}, frozenset({SOLO})) == []


# What the negotiation package must not import, at run time or for types.
NOT_IN_NEGOTIATION = {"hora", "hora_coordinator", "hora_native", "grpc", "grpc_health",
                      "asyncio", "fastapi", "starlette", "uvicorn"}


def _imported_tops(package: str) -> dict[str, set[str]]:
    """Every top-level module each module of ``package`` imports, read from its
    source (ast): imports inside functions and under ``if TYPE_CHECKING:`` included."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations
    found: dict[str, set[str]] = {}
    for path in sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.py")):
        tops: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops.update(alias.name.split(".", 1)[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops.add(node.module.split(".", 1)[0])
        found[path.name] = tops
    return found


def test_the_negotiation_package_needs_no_server_loop_or_service():
    imported = _imported_tops("hora_negotiation")
    assert "table.py" in imported and "solo.py" in imported
    assert {name: sorted(tops & NOT_IN_NEGOTIATION) for name, tops in imported.items()
            if tops & NOT_IN_NEGOTIATION} == {}


def test_the_import_reader_sees_type_only_and_nested_imports(tmp_path, monkeypatch):
    """The check above can fail: imports under TYPE_CHECKING and in functions count."""
    package = tmp_path / "leakypkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import grpc\n")
    (package / "a.py").write_text("def f():\n    import asyncio.events\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    imported = _imported_tops("leakypkg")
    assert imported["__init__.py"] & NOT_IN_NEGOTIATION == {"grpc"}
    assert imported["a.py"] & NOT_IN_NEGOTIATION == {"asyncio"}


BINDINGS = ("hora.torch", "hora.tensorflow", "hora.keras", "hora.lightning")


def test_the_framework_neutral_api_needs_no_framework_binding(graph):
    """``hora.world`` (init, ranks, process sets, handles) is what the bindings share."""
    needs = graph.find_upstream_modules("hora.world")
    assert needs and not [m for m in needs if m.startswith(BINDINGS)]
    for binding in ("hora.torch.mpi_ops", "hora.tensorflow.mpi_ops"):
        assert "hora.world" in _imports(graph, binding)


def _cycles(graph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(_imports(graph, m) & set(modules)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(root: str) -> None:
        # Iterative, so a deep graph cannot hit the recursion limit.
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            for nxt in edges[node]:
                if nxt in on_stack:
                    low[node] = min(low[node], low[nxt])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))

    for module in modules:
        if module not in index:
            visit(module)
    return groups


def test_no_module_import_cycles(typed_graph):
    assert _cycles(typed_graph) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: a two-module cycle is reported."""
    package = tmp_path / "cyclepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles(grimp.build_graph("cyclepkg")) == [["cyclepkg.a", "cyclepkg.b"]]


def test_the_cycle_finder_counts_type_only_imports(tmp_path, monkeypatch):
    """A cycle closed only by an ``if TYPE_CHECKING:`` import is a cycle too."""
    package = tmp_path / "typecyclepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("typecyclepkg", exclude_type_checking_imports=False)
    assert _cycles(graph) == [["typecyclepkg.a", "typecyclepkg.b"]]
