"""The test suite's own layout: test modules share code only through helper modules, and a
fixture of ``conftest.py`` means the same thing in every module."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

TESTS = Path(__file__).parent
OLD_NAMES: dict[str, set[str]] = {"cluster": set()}
"""Fixture names on their way out, and the modules that still use them (``conftest.py``)."""


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imported(tree: ast.Module) -> set[str]:
    """The top-level names of the modules ``tree`` imports, at any depth (in functions and
    ``if TYPE_CHECKING:`` blocks too)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _fixtures(tree: ast.Module) -> set[str]:
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any("fixture" in ast.unparse(d) for d in node.decorator_list)
    }


def _requested(tree: ast.Module) -> set[str]:
    """Parameter names of the module's tests and fixtures (what pytest fills in)."""
    names = set()
    fixtures = _fixtures(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and (
            node.name.startswith("test_") or node.name in fixtures
        ):
            names |= {a.arg for a in node.args.args + node.args.kwonlyargs}
    return names


def test_no_module_of_the_suite_imports_a_test_module_or_conftest() -> None:
    offenders = {
        path.name: sorted(
            n for n in _imported(_tree(path)) if n.startswith("test_") or n == "conftest"
        )
        for path in sorted(TESTS.glob("*.py"))
    }
    offenders = {name: found for name, found in offenders.items() if found}
    assert not offenders, (
        f"these modules import test modules (or conftest): {offenders}; move what they share "
        "into a helper module (models.py, helpers.py, pool.py, ...)"
    )


def test_no_test_module_redefines_a_conftest_fixture() -> None:
    shared = _fixtures(_tree(TESTS / "conftest.py"))
    redefined = {
        path.name: sorted(shared & _fixtures(_tree(path)))
        for path in sorted(TESTS.glob("test_*.py"))
    }
    redefined = {name: found for name, found in redefined.items() if found}
    assert not redefined, (
        f"these modules give conftest.py's fixtures another meaning: {redefined}; name "
        "theirs by what it gives instead (own_cluster_2, pooled_cluster_2_long_timeout, ...)"
    )


def test_old_fixture_names_are_used_only_where_listed() -> None:
    users = {
        old: {p.name for p in TESTS.glob("test_*.py") if old in _requested(_tree(p))}
        for old in OLD_NAMES
    }
    assert all(users[old] <= OLD_NAMES[old] for old in OLD_NAMES), (
        f"old fixture names in use: {users}; use pooled_cluster_2 instead of cluster"
    )
