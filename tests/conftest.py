"""Shared fixtures: real clusters (MPI engines, gloo) and a real IPython shell."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell
from pool import ClusterPool

import axon_nb

# Functions defined in test modules are pickled by reference; engines inherit this environment
# and so can import them.
_TESTS = str(Path(__file__).parent)

if os.environ.get("AXON_TEST_TIMELINE"):  # when each test ran (tests/timeline.py)
    pytest_plugins = ["timeline"]
collect_ignore = ["server_ext"]  # run under Jupyter Server's plugin by test_server_ext.py
# The one-process references (train_local) and checks run in this process, beside the other
# worker and every rank, on two cores: with a second torch thread the same 12-step reference
# took 1.6 s of CPU for 0.84 s (its OpenMP thread spins after each op), with one 0.79 s for
# 0.81 s, the same losses. The ranks choose their own threads (rank/world/bootstrap.py).
torch.set_num_threads(1)
# The suite runs 4 ranks on 2-core machines: more ranks than cores, on purpose.
os.environ["AXON_NB_OVERSUBSCRIBE"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)
# `make test` runs three workers (pytest-xdist): each has its own Jupyter runtime dir, so the
# lab registry, kernels and servers of one never show up in another's tests.
os.environ["JUPYTER_RUNTIME_DIR"] = tempfile.mkdtemp(
    prefix=f"axon-nb-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-"
)
atexit.register(shutil.rmtree, os.environ["JUPYTER_RUNTIME_DIR"], ignore_errors=True)
# The Ctrl-C tests send this process SIGINT, as Jupyter does to a kernel. A suite started in the
# background by a non-interactive shell (`make test &` in a script) inherits SIGINT ignored,
# Python then installs no handler, and each of those tests waited out its timeout.
if threading.current_thread() is threading.main_thread() and (
    signal.getsignal(signal.SIGINT) is signal.SIG_IGN
):
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def cluster_pool() -> Iterator[ClusterPool]:
    pool = ClusterPool()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def no_pooled_clusters(cluster_pool: ClusterPool) -> None:
    """For modules that count every process (or port) of this worker: the pool's clusters
    are stopped first (a later module that asks for one starts it again)."""
    cluster_pool.close()


@pytest.fixture(scope="module")
def pooled_cluster_2(cluster_pool: ClusterPool) -> axon_nb.Cluster:
    """Two MPI ranks on gloo from the pool: shared by a module's tests and with later modules
    (started anew only when an earlier module left it unhealthy)."""
    return cluster_pool.get(2)


@pytest.fixture(scope="module")
def pooled_cluster_4(cluster_pool: ClusterPool) -> axon_nb.Cluster:
    """Four MPI ranks on gloo from the pool, shared like ``pooled_cluster_2``."""
    return cluster_pool.get(4)


@pytest.fixture(scope="module")
def shell() -> Iterator[InteractiveShell]:
    """A real IPython shell with the extension loaded; its cluster is stopped afterwards."""
    ip = InteractiveShell.instance()
    ip.extension_manager.load_extension("axon_nb")
    yield ip
    ip.extension_manager.unload_extension("axon_nb")


SLOW_FIRST = (
    "test_docs.py", "test_binder.py", "test_recovery.py", "test_train_model_parallel.py",
    "test_relayout.py", "test_hosts.py", "test_hang.py",
    "test_stop.py", "test_train_fsdp.py", "test_kernel_exit.py", "test_lifecycle.py",
    "test_interrupts.py", "test_checkpoint.py", "test_train_ddp.py", "test_hf_models.py",
    "test_predictions.py", "test_rescue.py",
)  # fmt: skip
"""The longest files (by `pytest --durations=0`), started first: `make test` hands whole files
to the workers in this order (pytest-xdist's loadfile with --no-loadscope-reorder; its default
order, most tests first, left the 150 s file of one test running alone at the end)."""


LAST = ("test_start_under_load.py",)
"""Handed out last: its CPU hog then runs while the other workers end their last files and
after, on a core that would idle, rather than for six minutes against the whole suite (its
twenty starts beside the suite took 346 s, and the hog a core's share all that time)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        if name in LAST:
            return len(SLOW_FIRST) + 1 + LAST.index(name)
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: tests keep their order within a file
