"""``cluster.compare``: strategies side by side on the live ranks; a candidate that cannot run
says why in its row and the others run."""

from __future__ import annotations

import pytest
from models import make_data, make_mlp, mse

import axon_nb
from axon_nb import DDP, FSDP, Hybrid, LocalSGD, Pipeline, ZeRO

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def test_strategies_side_by_side_and_failures_in_their_rows(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    params = sum(p.numel() for p in make_mlp().parameters())
    table = pooled_cluster_2.compare(
        [DDP(), ZeRO(stage=2), FSDP(), Hybrid(dp=2, tp=2), Pipeline(microbatches=3),
         LocalSGD(period=2)],
        model=make_mlp, data=make_data, loss=mse, batch_size=32, steps=6, warmup=2,
    )  # fmt: skip
    rows = {r["strategy"].split("(")[0]: r for r in table.rows}
    assert [r["status"] for r in table.rows][:3] == ["ok", "ok", "ok"]
    assert "must multiply to the world size" in rows["Hybrid"]["status"]
    assert "microbatches=3 must divide the 32 samples" in rows["Pipeline"]["status"]
    assert rows["LocalSGD"]["status"] == "ok"  # the ones after a failure still ran
    ddp, fsdp = rows["DDP"], rows["FSDP"]
    assert ddp["comm_bytes_per_step"] == 4 * params + 16  # gradients + the loop's agreement
    assert fsdp["peak_bytes"] < ddp["peak_bytes"]  # sharded
    assert abs(ddp["loss"] - fsdp["loss"]) < 1e-4  # same model, data and seed
    assert all(r["samples_per_s"] > 0 for r in table.rows if r["status"] == "ok")
    text = str(table)
    assert text.splitlines()[0].split()[:2] == ["strategy", "samples/s"]
    assert "<table>" in table._repr_html_()
    runs = pooled_cluster_2.run(_runs, stream=False)
    assert runs == [{}, {}]


def test_compare_refuses_what_it_sets_itself(pooled_cluster_2: axon_nb.Cluster) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'strategy'"):
        pooled_cluster_2.compare(
            [DDP()], strategy=DDP(), model=make_mlp, data=make_data, batch_size=8
        )
    with pytest.raises(ValueError, match="needs a list of strategies"):
        pooled_cluster_2.compare([], model=make_mlp, data=make_data, batch_size=8)


def _runs() -> dict:
    from axon_nb.rank.training import trainstate

    return trainstate.runs()
