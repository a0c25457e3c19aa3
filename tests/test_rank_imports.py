"""The rank side never loads the kernel side: after a start, a training run, a checkpoint and
a bandwidth test, no rank has imported widgets, the cluster, the server or the magics."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from models import make_data, make_mlp, mse

import axon_nb

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[axon_nb.Cluster]:
    """A fresh cluster: a pooled one may have imported earlier test modules (and through them
    the kernel side) to run their functions."""
    with axon_nb.Cluster(n=2, timeout=60) as fresh:
        yield fresh


KERNEL_SIDE = ("axon_nb.cluster", "axon_nb.widgets", "axon_nb.server", "axon_nb.magics",
               "axon_nb.train", "axon_nb.checkpoint", "axon_nb.estimate", "ipywidgets",
               "anywidget")  # fmt: skip


def _kernel_side_modules() -> list[str]:
    return sorted(
        name
        for name in sys.modules
        if any(name == k or name.startswith(k + ".") for k in KERNEL_SIDE)
    )


def test_ranks_load_no_kernel_side_module(cluster: axon_nb.Cluster, tmp_path: Path) -> None:
    cluster.train(make_mlp, make_data(), loss=mse, steps=3, batch_size=16)
    cluster.save(tmp_path / "ckpt")
    cluster.load(tmp_path / "ckpt")
    cluster.bandwidth("all_reduce", sizes="1K:1K", iters=1, warmup=0)
    assert cluster.run(_kernel_side_modules, stream=False) == [[], []]
    assert "torch" in cluster.run(lambda: sorted(sys.modules), stream=False)[0]  # (it looks)
