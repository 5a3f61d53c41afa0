"""The import graph of every kvcoord module, client and server (built by grimp from the
sources, lazy and TYPE_CHECKING imports included): each package imports only the layers
below it, and no module imports itself back through others.

    kvcoord.conformance   the trace replayer: a tool on top of the client
    kvcoord.client        the worker's library          kvcoord.service   the server
    kvcoord.wire          engine values <-> messages, shared by both sides
    kvcoord.engine        vLLM's rules, pure            kvcoord.v1        generated messages
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What each of our packages may import of ours (itself included).
ALLOWED: dict[str, set[str]] = {
    "kvcoord.engine": {"kvcoord.engine"},
    "kvcoord.v1": {"kvcoord.v1"},
    "kvcoord.wire": {"kvcoord.wire", "kvcoord.engine", "kvcoord.v1"},
    "kvcoord.client": {"kvcoord.client", "kvcoord.wire", "kvcoord.engine", "kvcoord.v1"},
    "kvcoord.service": {"kvcoord.service", "kvcoord.wire", "kvcoord.engine", "kvcoord.v1"},
    "kvcoord.conformance": {
        "kvcoord.conformance",
        "kvcoord.client",
        "kvcoord.wire",
        "kvcoord.engine",
        "kvcoord.v1",
    },
}

#: Import cycles that exist today, each as the set of modules it runs through. Issue 21
#: (item 4: "no import cycle anywhere in the client or the server") removes them; the
#: lead deletes an entry once the change that breaks it is merged. A cycle not listed
#: here fails the test, and so does an entry that is no longer a cycle.
KNOWN_CYCLES: list[frozenset[str]] = []  # none left (issue 21): keep it so


@pytest.fixture(scope="module")
def graph() -> Iterator[grimp.ImportGraph]:
    """The graph of the sources in this tree (client/ and server/ first on the path)."""
    saved = list(sys.path)
    sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]
    try:
        yield grimp.build_graph("kvcoord", cache_dir=None)
    finally:
        sys.path[:] = saved


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _ours(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    """Every module of ours -> the modules of ours it imports."""
    mods = {m for m in graph.modules if m.startswith("kvcoord.")}
    return {m: {x for x in graph.find_modules_directly_imported_by(m) if x in mods} for m in mods}


def _cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    found.append(frozenset(component))
    return found


def test_every_package_imports_only_the_layers_below_it(graph: grimp.ImportGraph) -> None:
    edges = _ours(graph)
    assert {_package(m) for m in edges} == set(ALLOWED), "a package of ours has no layer rule"
    bad = []
    for importer, imported in sorted((a, b) for a, targets in edges.items() for b in targets):
        if _package(imported) not in ALLOWED[_package(importer)]:
            for detail in graph.get_import_details(importer=importer, imported=imported):
                bad.append(f"{importer}:{detail['line_number']} {detail['line_contents']}")
    assert not bad, "imports across the layers:\n" + "\n".join(bad)


def test_the_server_imports_nothing_of_the_client_or_the_replayer(graph: grimp.ImportGraph) -> None:
    for upper in ("kvcoord.client", "kvcoord.conformance"):
        chain = graph.find_shortest_chains(importer="kvcoord.service", imported=upper, as_packages=True)
        assert not chain, f"kvcoord.service reaches {upper}: {sorted(chain)}"


def test_no_import_cycle_but_the_known_ones(graph: grimp.ImportGraph) -> None:
    cycles = set(_cycles(_ours(graph)))
    new = [sorted(c) for c in cycles - set(KNOWN_CYCLES)]
    assert not new, f"new import cycles: {new}"
    gone = [sorted(c) for c in set(KNOWN_CYCLES) - cycles]
    assert not gone, f"no longer cycles (delete them from KNOWN_CYCLES): {gone}"


def test_the_cycle_finder_finds_cycles() -> None:
    """The finder itself, on graphs whose cycles are known by construction."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    assert set(_cycles(edges)) == {frozenset("abc"), frozenset("e")}
    assert _cycles({"a": {"b"}, "b": set()}) == []
