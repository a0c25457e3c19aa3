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
def tensor_dataset() -> TensorDataset:
    return dataset()


def test_sent_once_then_reused_equal_to_train_local_and_the_callable_form(
    pooled_cluster_2: axon_nb.Cluster, tensor_dataset: TensorDataset
) -> None:
    ref = axon_nb.train_local(**ARGS, data=tensor_dataset)
    base = dataclasses.replace(notebook_data.stats(pooled_cluster_2))
    first = pooled_cluster_2.train(**ARGS, data=tensor_dataset)
    sent = dataclasses.replace(notebook_data.stats(pooled_cluster_2))
    assert sent.tensors_sent - base.tensors_sent == 2  # one host: each tensor once
    assert sent.bytes_sent - base.bytes_sent == sum(t.nbytes for t in tensor_dataset.tensors)
    assert first.losses == pytest.approx(ref.losses, rel=1e-5)

    second = pooled_cluster_2.train(**ARGS, data=tensor_dataset)
    again = notebook_data.stats(pooled_cluster_2)
    assert (again.tensors_sent, again.bytes_sent) == (sent.tensors_sent, sent.bytes_sent)
    assert again.tensors_reused == sent.tensors_reused + 2
    assert second.losses == first.losses

    uncached = pooled_cluster_2.train(
        **ARGS, data=lambda: tensor_dataset
    )  # pickled whole to every rank
    assert notebook_data.stats(pooled_cluster_2).calls == again.calls
    assert uncached.losses == first.losses


def test_the_ranks_of_a_host_map_one_copy_and_no_file_stays(
    pooled_cluster_2: axon_nb.Cluster, tensor_dataset: TensorDataset
) -> None:
    pooled_cluster_2.train(**ARGS, data=tensor_dataset)
    maps = pooled_cluster_2.run(mapped_copies, stream=False)
    assert len(maps[0]) == 2 and maps[0] == maps[1]  # the same two files, mapped by both
    pids = [r["pid"] for r in pooled_cluster_2.ranks]  # other test workers may be writing theirs
    assert [p for pid in pids for p in leftovers(pid)] == []  # unlinked once every rank mapped it


def test_an_in_place_change_is_noticed_and_only_it_sent_again(
    pooled_cluster_2: axon_nb.Cluster, tensor_dataset: TensorDataset
) -> None:
    x, y = tensor_dataset.tensors
    pooled_cluster_2.train(**ARGS, data=tensor_dataset)
    keys = pooled_cluster_2.run(held_keys, stream=False)[0]
    before = dataclasses.replace(notebook_data.stats(pooled_cluster_2))

    x[5] += 1.0  # torch counts this write (the tensor's version)
    changed = pooled_cluster_2.train(**ARGS, data=tensor_dataset)
    after = dataclasses.replace(notebook_data.stats(pooled_cluster_2))
    assert (after.tensors_sent, after.bytes_sent) == (
        before.tensors_sent + 1,
        before.bytes_sent + x.nbytes,
    )
    assert changed.losses == pytest.approx(
        axon_nb.train_local(**ARGS, data=tensor_dataset).losses, rel=1e-5
    )
    now = pooled_cluster_2.run(held_keys, stream=False)
    assert now[0] == now[1] and len(now[0]) == 2 and len(set(now[0]) & set(keys)) == 1

    y.numpy()[0, 0] = 7.0  # torch does not count this one; the first sampled window sees it
    pooled_cluster_2.train(**ARGS, data=tensor_dataset)
    assert notebook_data.stats(pooled_cluster_2).bytes_sent == after.bytes_sent + y.nbytes


def test_a_copy_written_on_a_rank_is_sent_again(
    pooled_cluster_2: axon_nb.Cluster, tensor_dataset: TensorDataset
) -> None:
    pooled_cluster_2.train(**ARGS, data=tensor_dataset)
    before = notebook_data.stats(pooled_cluster_2).tensors_sent

    def scribble() -> None:
        from axon_nb.rank.data import shared_tensors

        next(iter(shared_tensors._held.values())).tensor.zero_()

    pooled_cluster_2.run(scribble, ranks=[1], stream=False)
    result = pooled_cluster_2.train(**ARGS, data=tensor_dataset)
    assert notebook_data.stats(pooled_cluster_2).tensors_sent == before + 1
    assert result.losses == pytest.approx(
        axon_nb.train_local(**ARGS, data=tensor_dataset).losses, rel=1e-5
    )


def test_eval_data_and_the_data_of_evaluate_and_predict_are_shared_the_same_way(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """Every dataset argument goes through the once-per-host sharing: ``eval_data`` during
    training, then ``evaluate`` and ``predict`` on the same object send nothing again, and
    give what the uncached callable form gives."""
    held_out = dataset()
    base = dataclasses.replace(notebook_data.stats(pooled_cluster_2))
    pooled_cluster_2.train(
        **ARGS, data=lambda: held_out, eval_data=held_out, eval_every=3, name="shared_eval"
    )
    trained = dataclasses.replace(notebook_data.stats(pooled_cluster_2))
    assert trained.tensors_sent - base.tensors_sent == 2  # eval_data's two tensors, once
    shared = pooled_cluster_2.evaluate(held_out, loss=mse, batch_size=64, name="shared_eval")
    outputs = pooled_cluster_2.predict(held_out, batch_size=64, name="shared_eval")
    after = notebook_data.stats(pooled_cluster_2)
    assert (after.tensors_sent, after.bytes_sent) == (trained.tensors_sent, trained.bytes_sent)
    assert after.tensors_reused == trained.tensors_reused + 4  # evaluate's and predict's
    whole = pooled_cluster_2.evaluate(
        lambda: held_out, loss=mse, batch_size=64, name="shared_eval"
    )  # pickled whole to every rank
    assert shared == whole
    assert torch.equal(outputs, pooled_cluster_2.predict(lambda: held_out, batch_size=64,
                                                         name="shared_eval"))  # fmt: skip


def test_nothing_stays_in_dev_shm_after_the_cluster_stops(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    # A transfer cut short leaves its file: the engine's parent removes it when the engine ends.
    piece = ("cut-short", 1 << 20, 0, bytes(4096))
    made = pooled_cluster_2.run(entry.shared_write, [piece], ranks=[0], stream=False)[0]
    assert os.path.exists(made["cut-short"])
    pids = [r["pid"] for r in pooled_cluster_2.ranks]
    pooled_cluster_2.stop()
    assert [p for pid in pids for p in leftovers(pid)] == []
