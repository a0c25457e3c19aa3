"""Shared fixtures: real clusters (MPI engines, gloo) and a real IPython shell."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from IPython.core.interactiveshell import InteractiveShell

import axon_nb

# Functions defined in test modules are pickled by reference; engines inherit this environment
# and so can import them.
_TESTS = str(Path(__file__).parent)

collect_ignore = ["server_ext"]  # run under Jupyter Server's plugin by test_server_ext.py
# The suite runs 4 ranks on 2-core machines: more ranks than cores, on purpose.
os.environ["AXON_NB_OVERSUBSCRIBE"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)
# `make test` runs two workers (pytest-xdist): each has its own Jupyter runtime dir, so the
# lab registry, kernels and servers of one never show up in the other's tests.
os.environ["JUPYTER_RUNTIME_DIR"] = tempfile.mkdtemp(
    prefix=f"axon-nb-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-"
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[axon_nb.Cluster]:
    """Two MPI ranks on gloo, shared by a module's tests (a module may define its own)."""
    with axon_nb.Cluster(n=2, timeout=60) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def cluster4() -> Iterator[axon_nb.Cluster]:
    """Four MPI ranks on gloo, shared by a module's tests."""
    with axon_nb.Cluster(n=4, timeout=60) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def shell() -> Iterator[InteractiveShell]:
    """A real IPython shell with the extension loaded; its cluster is stopped afterwards."""
    ip = InteractiveShell.instance()
    ip.extension_manager.load_extension("axon_nb")
    yield ip
    ip.extension_manager.unload_extension("axon_nb")


SLOW_FIRST = (
    "test_train_model_parallel.py", "test_recovery.py", "test_lab_sidebar.py",
    "test_hf_models.py", "test_train_fsdp.py", "test_stop.py", "test_hang.py",
    "test_checkpoint.py", "test_lifecycle.py", "test_notebook.py", "test_parallel_options.py",
    "test_hosts.py",
)  # fmt: skip
"""The longest files, started first: `make test` hands whole files to two workers in this
order (pytest-xdist's loadfile), so none of them is left running alone at the end."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: tests keep their order within a file
