"""No import cycle among the modules of any ``tasks`` package, counting every import: at module level,
inside functions, and under ``if TYPE_CHECKING:``.

The "no import cycles between the modules of any package" contract (``acyclic_siblings`` in
pyproject.toml) sees imports inside functions, but import-linter's graph drops those under ``if
TYPE_CHECKING:`` (``exclude_type_checking_imports = true``, a setting of the whole configuration, not
of one contract). A type-only import still ties two modules together: ``vllm_server.claims`` imported
``weights`` inside a function while ``weights`` imported ``claims``' ``ServerClaim`` for its type
hints, a circle the contract kept. This test builds grimp's graph with every import, so it sees one.

As the contract does, a package's subpackage counts as one node with everything under it.
``KNOWN_CYCLES`` lists the cycles of modules this test's owners do not own, each to be broken by
its owner; the test fails on any other, and on a listed one that is gone (so the list only shrinks).
"""

from __future__ import annotations

import grimp
import pytest

# package -> the sets of its children that form a cycle today (type-checking imports included).
KNOWN_CYCLES: dict[str, set[frozenset[str]]] = {
    # roots imports objects' ObjectStore under TYPE_CHECKING; objects imports roots' URL checks.
    "tasks.storage": {frozenset({"tasks.storage.roots", "tasks.storage.objects"})},
}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(
        "tasks", include_external_packages=False, exclude_type_checking_imports=False, cache_dir=None
    )


def cycles_among_children(graph: grimp.ImportGraph, package: str) -> set[frozenset[str]]:
    """The strongly connected components of more than one child of ``package`` (a child with its descendants)."""
    children = sorted(graph.find_children(package))
    edges = {
        child: [
            other
            for other in children
            if other != child and graph.direct_import_exists(importer=child, imported=other, as_packages=True)
        ]
        for child in children
    }
    reaches = {child: _reachable(child, edges) for child in children}
    components: set[frozenset[str]] = set()
    for child in children:
        component = frozenset(other for other in reaches[child] if child in reaches[other])
        if len(component) > 1:
            components.add(component)
    return components


def _reachable(start: str, edges: dict[str, list[str]]) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for other in edges[todo.pop()]:
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def _described(graph: grimp.ImportGraph, component: frozenset[str]) -> str:
    """The imports that tie a cycle's modules (each lies on the cycle), one a line with its line number."""
    lines = set()
    for importer in component:
        for imported in component - {importer}:
            for upstream in {importer, *graph.find_descendants(importer)}:
                for downstream in {imported, *graph.find_descendants(imported)}:
                    for detail in graph.get_import_details(importer=upstream, imported=downstream):
                        lines.add(f"  {upstream}:{detail['line_number']}: {detail['line_contents']}")
    return "\n".join(sorted(lines))


def all_cycles(graph: grimp.ImportGraph) -> dict[str, set[frozenset[str]]]:
    found = {}
    for package in sorted(module for module in graph.modules if graph.find_children(module)):
        if cycles := cycles_among_children(graph, package):
            found[package] = cycles
    return found


def test_no_package_has_an_import_cycle_among_its_modules(graph: grimp.ImportGraph) -> None:
    found = all_cycles(graph)
    new = {package: cycles - KNOWN_CYCLES.get(package, set()) for package, cycles in found.items()}
    new = {package: cycles for package, cycles in new.items() if cycles}
    assert not new, "import cycles (move what both modules need below both):\n" + "\n".join(
        f"{package}: {' <-> '.join(sorted(cycle))}\n{_described(graph, cycle)}"
        for package, cycles in new.items()
        for cycle in cycles
    )
    gone = {package: cycles - found.get(package, set()) for package, cycles in KNOWN_CYCLES.items()}
    assert not any(gone.values()), f"these known cycles are gone: remove them from KNOWN_CYCLES: {gone}"


def test_the_check_sees_imports_inside_functions_and_type_checking_imports(tmp_path, monkeypatch) -> None:
    """A package whose two modules import each other, one inside a function, the other for type hints only."""
    package = tmp_path / "cyclepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from cyclepkg.b import g\n    return g()\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyclepkg.a import f\ndef g(): return 1\n"
    )
    (package / "c.py").write_text("from cyclepkg import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyclepkg", exclude_type_checking_imports=False, cache_dir=None)
    assert all_cycles(graph) == {"cyclepkg": {frozenset({"cyclepkg.a", "cyclepkg.b"})}}
    assert "cyclepkg.b:3: from cyclepkg.a import f" in _described(graph, frozenset({"cyclepkg.a", "cyclepkg.b"}))
    # import-linter's graph (type-checking imports dropped) has no cycle here: why this test exists
    assert not all_cycles(grimp.build_graph("cyclepkg", exclude_type_checking_imports=True, cache_dir=None))
