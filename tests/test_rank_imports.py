"""The rank side never loads the kernel side: after a start, a training run, a checkpoint and
a bandwidth test, no rank has imported widgets, the cluster, the server or the magics. And a
run loads only the parts of torch.distributed that its strategy uses."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from models import make_data, make_mlp, mse

import axon_nb
from axon_nb import DDP

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def own_cluster_2() -> Iterator[axon_nb.Cluster]:
    """Two ranks of this module's own, stopped after it: a pooled one may have imported
    earlier test modules (and through them the kernel side) to run their functions."""
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


HEAVY = ("torch.distributed.pipelining", "torch.distributed.checkpoint")
"""Loaded by a run that pipelines or checkpoints: 1.5 s and 1 s of CPU on every rank."""


def _heavy_modules() -> list[str]:
    return [name for name in HEAVY if name in sys.modules]


def test_a_ddp_run_loads_no_pipelining_or_checkpointing(own_cluster_2: axon_nb.Cluster) -> None:
    """(First in this module: the next test checkpoints.) A first DDP call took 2.5 s, 2.0 s
    without these imports."""
    own_cluster_2.train(make_mlp, make_data(), loss=mse, steps=3, batch_size=16, strategy=DDP())
    assert own_cluster_2.run(_heavy_modules, stream=False) == [[], []]


def test_ranks_load_no_kernel_side_module(own_cluster_2: axon_nb.Cluster, tmp_path: Path) -> None:
    own_cluster_2.train(make_mlp, make_data(), loss=mse, steps=3, batch_size=16)
    own_cluster_2.save(tmp_path / "ckpt")
    own_cluster_2.load(tmp_path / "ckpt")
    own_cluster_2.bandwidth("all_reduce", sizes="1K:1K", iters=1, warmup=0)
    assert own_cluster_2.run(_kernel_side_modules, stream=False) == [[], []]
    assert "torch" in own_cluster_2.run(lambda: sorted(sys.modules), stream=False)[0]  # (it looks)
