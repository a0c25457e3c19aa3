"""``compile=True``: the model's blocks run through torch.compile (inductor, on the CPU here),
and training equals the uncompiled one-process reference within float tolerance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from equivalence import check_equal
from models import make_data, make_mlp, mse

import axon_nb
from axon_nb import DDP, FSDP, Pipeline, TensorParallel, ZeRO
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset
from axon_nb.parallel.compile import apply_compile

if TYPE_CHECKING:
    from pool import ClusterPool

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

ARGS: dict[str, Any] = dict(
    model=lambda: GPT(GPTConfig(n_layer=2, n_head=2)),
    data=token_dataset,
    loss=lm_loss,
    steps=4,
    batch_size=16,
    # SGD: AdamW turns the float noise in gradients that are zero in exact arithmetic (the key
    # bias's) into steps of about lr, whatever computes them.
    optimizer=("sgd", {"lr": 0.05, "momentum": 0.9}),
)
TOL = 1e-4
"""Inductor fuses and reorders float arithmetic: differences of ~1e-6 per step."""


@pytest.fixture(scope="module")
def pooled_cluster_2_long_timeout(cluster_pool: ClusterPool) -> axon_nb.Cluster:
    """Two pooled ranks whose calls wait 300 s (the first compile keeps a peer waiting)."""
    return cluster_pool.get(2, timeout=300)


@pytest.fixture(scope="module")
def reference() -> axon_nb.TrainResult:
    return axon_nb.train_local(**ARGS)  # not compiled


def _forget_compiled() -> None:
    """(On a rank) drop torch.compile's compiled code and counters: the next run compiles anew."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _graphs_compiled() -> int:
    """(On a rank) graphs torch.compile captured since :func:`_forget_compiled`."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize(
    "strategy",
    [DDP(), FSDP(), ZeRO(stage=2), Pipeline(microbatches=2), TensorParallel()],
    ids=["ddp", "fsdp", "zero2", "pipeline", "tensor"],
)
def test_compiled_blocks_train_as_the_uncompiled_model(
    pooled_cluster_2_long_timeout: axon_nb.Cluster, reference: axon_nb.TrainResult, strategy: Any
) -> None:
    pooled_cluster_2_long_timeout.run(_forget_compiled, stream=False)
    args = {**ARGS, "strategy": strategy, "compile": True}
    check_equal(pooled_cluster_2_long_timeout, reference, args, loss_tol=TOL, param_tol=TOL)
    assert all(
        pooled_cluster_2_long_timeout.run(_graphs_compiled, stream=False)
    )  # it did run compiled


def test_a_model_without_blocks_is_compiled_whole() -> None:
    model = make_mlp()
    assert apply_compile(model) == [""]
    assert apply_compile(GPT(GPTConfig(n_layer=3))) == ["blocks.0", "blocks.1", "blocks.2"]
    args = dict(model=make_mlp, data=make_data, loss=mse, steps=3, batch_size=16)
    plain = axon_nb.train_local(**args)
    compiled = axon_nb.train_local(**args, compile=True)
    assert compiled.losses == pytest.approx(plain.losses, abs=TOL)
    names = [n for n, _ in compiled.model.named_parameters()]
    assert names == [n for n, _ in plain.model.named_parameters()]  # checkpoints unchanged


def test_compile_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="compile must be True or False, got 'yes'"):
        axon_nb.train_local(model=make_mlp, data=make_data, steps=1, batch_size=8, compile="yes")
