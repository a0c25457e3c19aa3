"""The shape of the package: no import circles (TYPE_CHECKING imports counted), small files,
a small Cluster. The side contracts themselves are import-linter's (`make lint`)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import grimp

import axon_nb

PACKAGE = Path(axon_nb.__file__).parent


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def below(module: str):  # type: ignore[no-untyped-def]
        return iter(sorted(graph.find_modules_directly_imported_by(module)))

    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, below(root))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_circles() -> None:
    graph = grimp.build_graph("axon_nb", cache_dir=None)
    assert _cycles(graph) == []


def test_the_check_finds_a_circle() -> None:
    graph = grimp.ImportGraph()
    for name in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(name)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph) == [["p.a", "p.b"]]


def test_no_file_over_450_lines_no_function_over_80_and_a_small_cluster() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 450
    }
    assert long == {}
    functions = {
        f"{p.relative_to(PACKAGE)}:{node.name}": length
        for p in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > 80
    }
    assert functions == {}
    assert len(inspect.getsource(axon_nb.Cluster).splitlines()) < 350
