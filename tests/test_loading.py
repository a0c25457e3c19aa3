"""How data reaches the steps: iterable streams sharded by rank and loader worker with steps
aligned and exact resumes, and the DataLoader options (workers, pinning, prefetch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from equivalence import check_equal
from models import Stream, make_data, make_mlp, mse

import axon_nb

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ARGS: dict[str, Any] = dict(model=make_mlp, loss=mse, steps=10, batch_size=16)
WORKERS = dict(num_workers=2, persistent_workers=True, prefetch_factor=2)


@pytest.mark.parametrize("loader", [None, WORKERS], ids=["in-process", "two-workers"])
def test_a_stream_trains_as_in_one_process(pooled_cluster_2: axon_nb.Cluster, loader: Any) -> None:
    ref = axon_nb.train_local(**ARGS, data=Stream())  # items s*16 .. (s+1)*16 at step s
    args = {**ARGS, "data": Stream(), "loader": loader}
    check_equal(pooled_cluster_2, ref, args, loss_tol=1e-5, param_tol=1e-5)


def test_ranks_stop_together_when_a_stream_runs_out(pooled_cluster_2: axon_nb.Cluster) -> None:
    # 111 items: rank 0 reads 56 (7 batches of 8), rank 1 reads 55 (6 whole batches)
    result = pooled_cluster_2.train(**{**ARGS, "steps": 50}, data=Stream(111))
    assert result.data_ended_at == result.step == 6 and result.status == "finished"
    assert len(result.history) == 6
    with pytest.raises(Exception, match="the data gave no complete step"):
        pooled_cluster_2.train(**ARGS, data=Stream(10))
    assert pooled_cluster_2.train(**ARGS, data=Stream()).step == 10  # the ranks are fine


def test_a_resumed_stream_goes_on_where_it_stopped(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    whole = pooled_cluster_2.train(**ARGS, data=Stream(), loader=WORKERS, name="whole")
    pooled_cluster_2.train(**{**ARGS, "steps": 4}, data=Stream(), loader=WORKERS, name="part")
    pooled_cluster_2.save(tmp_path / "ckpt", name="part")  # records step 4: the stream's position
    rest = pooled_cluster_2.train(**{**ARGS, "steps": 6}, name="part", resume=True)
    assert rest.losses == pytest.approx(whole.losses[4:], abs=1e-6)
    pooled_cluster_2.train(**{**ARGS, "steps": 0}, data=Stream(), loader=WORKERS, name="loaded")
    pooled_cluster_2.load(tmp_path / "ckpt", name="loaded")
    again = pooled_cluster_2.train(**{**ARGS, "steps": 6}, name="loaded", resume=True)
    assert again.losses == pytest.approx(whole.losses[4:], abs=1e-6)


def test_loader_workers_give_the_same_run(pooled_cluster_2: axon_nb.Cluster) -> None:
    args = {**ARGS, "data": make_data}
    ref = axon_nb.train_local(**args)
    check_equal(pooled_cluster_2, ref, {**args, "loader": WORKERS}, loss_tol=1e-5, param_tol=1e-5)


@pytest.mark.parametrize(
    ("loader", "message"),
    [
        (dict(workers=2), r"unknown option\(s\) \['workers'\]; use num_workers"),
        (dict(prefetch_factor=2), "prefetch_factor need num_workers >= 1"),
        (dict(num_workers=-1), "num_workers must be an integer >= 0, got -1"),
        (dict(num_workers=1, pin_memory="yes"), "pin_memory must be True or False"),
        ([("num_workers", 2)], "loader must be a dict"),
    ],
)
def test_bad_loader_options_are_refused(loader: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        axon_nb.train_local(**ARGS, data=make_data, loader=loader)


class _Table(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((8,), i / 64)
        return x, x[:4] * 2


def test_a_dataset_class_is_a_factory_like_any_callable() -> None:
    result = axon_nb.train_local(**{**ARGS, "steps": 3}, data=_Table)  # built where it trains
    assert result.step == 3
