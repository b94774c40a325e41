"""The packages' import rules (issue 10), checked on the real import graph.

- ``hora_proto`` (the contract) imports none of the other three packages;
- ``hora_coordinator`` and ``hora_native`` never import ``hora``;
- ``hora`` reaches ``hora_coordinator`` only through ``hora.runner.embedded``;
- ``hora.world``, the framework-neutral API, needs no framework binding, and
  ``hora.torch`` and ``hora.tensorflow`` take it from there;
- no package has an import cycle between its modules (type-only imports aside).
"""

from __future__ import annotations

import pytest

grimp = pytest.importorskip("grimp")

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PACKAGES = ("hora", "hora_coordinator", "hora_native", "hora_proto")
ENTRY_POINT = "hora.runner.embedded"


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)


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
    assert _violations(graph, "hora_native", {"hora", "hora_coordinator"}) == []


def test_the_client_reaches_the_coordinator_through_one_entry_point(graph):
    assert ENTRY_POINT in graph.modules
    assert _violations(graph, "hora", {"hora_coordinator"}, frozenset({ENTRY_POINT})) == []


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


def test_no_module_import_cycles(graph):
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: a two-module cycle is reported."""
    package = tmp_path / "cyclepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles(grimp.build_graph("cyclepkg")) == [["cyclepkg.a", "cyclepkg.b"]]
