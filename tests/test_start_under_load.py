"""The "0 of N engines connected" flake under load (issue 23 item 5): twenty clusters in a
row start and stop while a CPU hog runs, and leave nothing behind. Its own file, which
`make test` hands out last (conftest.py's LAST)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import cluster_pids, wait_gone

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.usefixtures("no_pooled_clusters"),
    pytest.mark.timeout(600),
]


def _descendants() -> set[int]:
    return set(cluster_pids())


def test_twenty_starts_in_a_row_under_a_cpu_hog_all_start() -> None:
    """benchmarks/start_under_load.py (which starts 50): the "0 of N engines connected"
    flake under load. A failure prints its error and the end of the cluster's log. Every
    other start is a new warm process's, whose engines wait for it to import torch under the
    hog, the others fork from the one the stop before kept: both ways a start goes."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from start_under_load import start_many

    before = _descendants()
    # half of them from the warm process the stop before kept (a restart's start)
    assert start_many(20, hogs=1, warm_every=2) == 20
    assert wait_gone(list(_descendants() - before)) == []
