"""No import cycle anywhere in the project, lazy imports included.

import-linter's contracts (``lint-imports``, pyproject.toml) state which layer
may import which; this test states the simpler rule beneath them: the graph of
modules is acyclic. grimp reads every import statement in a module, those
inside functions and under ``TYPE_CHECKING`` too, so an import deferred to
dodge a cycle at import time still counts as the cycle it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import grimp

ROOTS = ("aurora_store", "workers", "aurora_tools")


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports directly (no cache written)."""
    graph = grimp.build_graph(*ROOTS, cache_dir=None)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def strongly_connected(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative (no recursion limit).

    Returns every component of more than one module, and every module that
    imports itself, each sorted; the list sorted by its first module.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(edges.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(edges.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges.get(node, ()):
                    found.append(sorted(component))
    return sorted(found)


def one_cycle(edges: Mapping[str, Iterable[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a module path."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for nxt in sorted(set(edges.get(node, ())) & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    return component  # unreachable for a true component


def test_tarjan_finds_cycles_and_self_imports() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    assert strongly_connected(edges) == [["a", "b", "c"], ["e"]]
    assert one_cycle(edges, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_anywhere() -> None:
    edges = import_graph()
    components = strongly_connected(edges)
    report = "\n".join(f"  {', '.join(c)}\n    e.g. " + " -> ".join(one_cycle(edges, c)) for c in components)
    assert not components, f"import cycles (lazy imports included):\n{report}"
