"""Datasets built in the notebook: their tensors go to each host once, the ranks of a host map
one shared copy, a second call with the same object sends nothing, a change is sent again, the
runs equal ``train_local`` and the uncached callable form, and nothing stays in ``/dev/shm``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from models import mse
from torch import nn
from torch.utils.data import TensorDataset

import axon_nb
from axon_nb.rank import entry
from axon_nb.spec.shared_data import leftovers
from axon_nb.train import notebook_data

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

ROWS, WIDTH, OUT = 4096, 128, 64  # inputs 2 MiB and targets 1 MiB: both held on the host


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, WIDTH, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :OUT]) + 0.1 * torch.randn(ROWS, OUT, generator=g))


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, OUT))


ARGS: dict[str, Any] = dict(model=model, loss=mse, steps=6, batch_size=64, seed=3)


def held_keys() -> list[str]:
    from axon_nb.rank.data import shared_tensors

    return sorted(shared_tensors.held_bytes())


def mapped_copies() -> set[tuple[str, str]]:
    """(device, inode) of every shared copy this rank maps (unlinked files show "(deleted)")."""
    with open("/proc/self/maps") as maps:
        return {
            (fields[3], fields[4])
            for fields in (line.split() for line in maps)
            if len(fields) > 5 and "axon_nb-data-" in fields[5]
        }


@pytest.fixture(scope="module")
def ds() -> TensorDataset:
    return dataset()


def test_sent_once_then_reused_equal_to_train_local_and_the_callable_form(
    cluster: axon_nb.Cluster, ds: TensorDataset
) -> None:
    ref = axon_nb.train_local(**ARGS, data=ds)
    base = dataclasses.replace(notebook_data.stats(cluster))
    first = cluster.train(**ARGS, data=ds)
    sent = dataclasses.replace(notebook_data.stats(cluster))
    assert sent.tensors_sent - base.tensors_sent == 2  # one host: each tensor once
    assert sent.bytes_sent - base.bytes_sent == sum(t.nbytes for t in ds.tensors)
    assert first.losses == pytest.approx(ref.losses, rel=1e-5)

    second = cluster.train(**ARGS, data=ds)
    again = notebook_data.stats(cluster)
    assert (again.tensors_sent, again.bytes_sent) == (sent.tensors_sent, sent.bytes_sent)
    assert again.tensors_reused == sent.tensors_reused + 2
    assert second.losses == first.losses

    uncached = cluster.train(**ARGS, data=lambda: ds)  # pickled whole to every rank
    assert notebook_data.stats(cluster).calls == again.calls
    assert uncached.losses == first.losses


def test_the_ranks_of_a_host_map_one_copy_and_no_file_stays(
    cluster: axon_nb.Cluster, ds: TensorDataset
) -> None:
    cluster.train(**ARGS, data=ds)
    maps = cluster.run(mapped_copies, stream=False)
    assert len(maps[0]) == 2 and maps[0] == maps[1]  # the same two files, mapped by both
    pids = [r["pid"] for r in cluster.ranks]  # other test workers may be writing theirs
    assert [p for pid in pids for p in leftovers(pid)] == []  # unlinked once every rank mapped it


def test_an_in_place_change_is_noticed_and_only_it_sent_again(
    cluster: axon_nb.Cluster, ds: TensorDataset
) -> None:
    x, y = ds.tensors
    cluster.train(**ARGS, data=ds)
    keys = cluster.run(held_keys, stream=False)[0]
    before = dataclasses.replace(notebook_data.stats(cluster))

    x[5] += 1.0  # torch counts this write (the tensor's version)
    changed = cluster.train(**ARGS, data=ds)
    after = dataclasses.replace(notebook_data.stats(cluster))
    assert (after.tensors_sent, after.bytes_sent) == (
        before.tensors_sent + 1,
        before.bytes_sent + x.nbytes,
    )
    assert changed.losses == pytest.approx(axon_nb.train_local(**ARGS, data=ds).losses, rel=1e-5)
    now = cluster.run(held_keys, stream=False)
    assert now[0] == now[1] and len(now[0]) == 2 and len(set(now[0]) & set(keys)) == 1

    y.numpy()[0, 0] = 7.0  # torch does not count this one; the first sampled window sees it
    cluster.train(**ARGS, data=ds)
    assert notebook_data.stats(cluster).bytes_sent == after.bytes_sent + y.nbytes


def test_a_copy_written_on_a_rank_is_sent_again(
    cluster: axon_nb.Cluster, ds: TensorDataset
) -> None:
    cluster.train(**ARGS, data=ds)
    before = notebook_data.stats(cluster).tensors_sent

    def scribble() -> None:
        from axon_nb.rank.data import shared_tensors

        next(iter(shared_tensors._held.values())).tensor.zero_()

    cluster.run(scribble, ranks=[1], stream=False)
    result = cluster.train(**ARGS, data=ds)
    assert notebook_data.stats(cluster).tensors_sent == before + 1
    assert result.losses == pytest.approx(axon_nb.train_local(**ARGS, data=ds).losses, rel=1e-5)


def test_nothing_stays_in_dev_shm_after_the_cluster_stops(cluster: axon_nb.Cluster) -> None:
    # A transfer cut short leaves its file: the engine's parent removes it when the engine ends.
    piece = ("cut-short", 1 << 20, 0, bytes(4096))
    made = cluster.run(entry.shared_write, [piece], ranks=[0], stream=False)[0]
    assert os.path.exists(made["cut-short"])
    pids = [r["pid"] for r in cluster.ranks]
    cluster.stop()
    assert [p for pid in pids for p in leftovers(pid)] == []
