"""``cluster.evaluate``: the model the ranks hold, over a set that does not divide by ranks x
batch, under its own strategy; equal to the same model evaluated in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_models import FixedTokens, TokenRows, pad, tiny_llama
from models import make_data, make_mlp, mse

import axon_nb
from axon_nb import DDP, FSDP, Pipeline, TensorParallel, ZeRO

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

ROWS = 37  # 2 ranks x batch 5 does not divide it: no sample may count twice


def mae(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).abs().mean()


def _one_process(model: torch.nn.Module, data: Any, metrics: dict, batch_size: int) -> dict:
    """The reference: every sample once, batch means weighted by their samples."""
    sums: dict[str, float] = {}
    model.eval()
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            items = [data[i] for i in range(start, min(start + batch_size, len(data)))]
            x, y = (torch.stack(t) for t in zip(*items, strict=True))
            out = model(x)
            for key, fn in {"loss": mse, **metrics}.items():
                sums[key] = sums.get(key, 0.0) + float(fn(out, y)) * len(items)
    return {k: v / len(data) for k, v in sums.items()}


def _full_model(name: str = "model") -> dict[str, torch.Tensor]:
    from axon_nb.rank.training import trainstate

    return trainstate.get(name).parallel.full_state_dict()


@pytest.mark.parametrize(
    "strategy", [DDP(), FSDP(), ZeRO(stage=2), Pipeline(microbatches=2)], ids=str
)
def test_the_held_model_evaluates_as_in_one_process(
    pooled_cluster_2: axon_nb.Cluster, strategy: Any
) -> None:
    test = make_data(ROWS)
    pooled_cluster_2.train(
        make_mlp, make_data(), loss=mse, strategy=strategy, steps=5, batch_size=16
    )
    got = pooled_cluster_2.evaluate(test, loss=mse, metrics={"mae": mae}, batch_size=5)
    model = make_mlp()
    model.load_state_dict(pooled_cluster_2.run(_full_model, stream=False)[0])
    want = _one_process(model, test, {"mae": mae}, 5)
    assert got["samples"] == ROWS
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["mae"] == pytest.approx(want["mae"], rel=1e-5)
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]  # the ranks still answer in step


def test_a_llama_under_tensor_parallel_evaluates_with_its_own_loss(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """Dict batches and the model's own loss; tensor-parallel peers read the same samples."""
    data = FixedTokens(count=ROWS)
    run = dict(model=tiny_llama, data=FixedTokens(), steps=3, batch_size=8)
    pooled_cluster_2.train(**run, strategy=TensorParallel(plan="auto"))
    got = pooled_cluster_2.evaluate(data, batch_size=5)
    model = tiny_llama()
    model.load_state_dict(pooled_cluster_2.run(_full_model, stream=False)[0])
    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, ROWS, 5):
            ids = data.ids[start : start + 5]
            total += float(model(input_ids=ids, labels=ids).loss) * len(ids)
    assert got["samples"] == ROWS
    assert got["loss"] == pytest.approx(total / ROWS, rel=1e-5)


def test_bad_input_says_what_to_do_and_the_ranks_stay_usable(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    pooled_cluster_2.train(make_mlp, make_data(), loss=mse, steps=1, batch_size=16)
    for bad, match in [
        (dict(batch_size=0), "batch_size must be a positive integer"),
        (dict(metrics={"mae": 3}), "metrics must map names to callables"),
        (dict(metrics={"loss": mae}), "cannot be named 'loss'"),
    ]:
        with pytest.raises(ValueError, match=match):
            pooled_cluster_2.evaluate(make_data(ROWS), **{"loss": mse, "batch_size": 5, **bad})
    for bad, match in [
        (dict(metrics={"per_row": lambda o, t: (o - t).abs()}), "'per_row' must return a scalar"),
        (dict(loss=None), "needs loss=loss"),
        (dict(name="nothing"), "nothing"),
    ]:
        with pytest.raises(axon_nb.RankError, match=match):
            pooled_cluster_2.evaluate(make_data(ROWS), **{"loss": mse, "batch_size": 5, **bad})
    with pytest.raises(axon_nb.RankError, match="the data has 1 samples, fewer than the 2 data"):
        pooled_cluster_2.evaluate(
            make_data(1), loss=mse, batch_size=5
        )  # every rank says so, none waits
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]


def test_variable_length_rows_evaluate_with_the_runs_collate_fn(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """Rows of different lengths, padded by the run's ``loader`` collate_fn in evaluation too:
    each rank's padded batches of its samples (``r, r + 2, ...``, 4 per forward), their
    losses weighted by samples, as one process computes them on the same weights."""
    rows = TokenRows(count=21)
    result = pooled_cluster_2.train(
        tiny_llama, TokenRows(), strategy=DDP(), steps=2, batch_size=8,
        loader={"collate_fn": pad}, eval_data=rows,
    )  # fmt: skip
    model = tiny_llama()
    model.load_state_dict(pooled_cluster_2.run(_full_model, stream=False)[0])
    model.eval()
    total = 0.0
    with torch.no_grad():
        for rank in range(2):
            mine = list(range(rank, len(rows), 2))
            for start in range(0, len(mine), 4):
                batch = pad([rows[i] for i in mine[start : start + 4]])
                total += float(model(**batch).loss) * len(batch["input_ids"])
    assert result.evals[-1]["samples"] == 21
    assert result.evals[-1]["loss"] == pytest.approx(total / 21, rel=1e-5)
