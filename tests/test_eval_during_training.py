"""Evaluation during training (``eval_data``, ``eval_every``, ``metrics``): under every
strategy, ``result.evals`` equals ``train_local``'s within 1e-5, on a set that does not divide
by ranks x batch (every sample counted once); bad input is refused before the run trains."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import axon_nb
from axon_nb import DDP, FSDP, Hybrid, Pipeline, TensorParallel, ZeRO
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ROWS = 37  # 2 ranks x 8 samples per forward does not divide it
CONFIG = GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16)


def logit_square(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A per-sample mean, so any batching of the set gives the same weighted mean."""
    return output.float().pow(2).mean()


RUN: dict[str, Any] = dict(
    model=functools.partial(GPT, CONFIG),
    data=functools.partial(token_dataset, 128, block_size=16, vocab_size=64),
    loss=lm_loss,
    steps=4,
    batch_size=16,
    optimizer=("adamw", {"lr": 3e-3}),
    eval_data=functools.partial(token_dataset, ROWS, block_size=16, vocab_size=64, seed=7),
    eval_every=2,
    metrics={"logit_square": logit_square},
)


@functools.cache
def reference() -> list[dict[str, Any]]:
    return axon_nb.train_local(**RUN).evals


def _check(evals: list[dict[str, Any]]) -> None:
    want = reference()
    assert [e["step"] for e in evals] == [e["step"] for e in want] == [2, 4]
    for got, ref in zip(evals, want, strict=True):
        assert got["samples"] == ROWS
        for key in ("loss", "logit_square"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5), (key, got, ref)
    assert evals[0]["loss"] != evals[1]["loss"]  # the model trained between them


TWO_RANKS = [
    DDP(), FSDP(), ZeRO(stage=1), ZeRO(stage=2), TensorParallel(), Pipeline(microbatches=2),
    Pipeline(microbatches=2, schedule="interleaved_1f1b", virtual_stages=2),
]  # fmt: skip


@pytest.mark.parametrize("strategy", TWO_RANKS, ids=str)
def test_evals_equal_train_local_on_two_ranks(
    pooled_cluster_2: axon_nb.Cluster, strategy: Any
) -> None:
    _check(pooled_cluster_2.train(**RUN, strategy=strategy).evals)


@pytest.mark.parametrize(
    "strategy", [Hybrid(dp=2, pp=2), Hybrid(dp=2, tp=2), Hybrid(tp=2, pp=2)], ids=str
)
def test_evals_equal_train_local_on_four_ranks(
    pooled_cluster_4: axon_nb.Cluster, strategy: Any
) -> None:
    _check(pooled_cluster_4.train(**RUN, strategy=strategy).evals)


def test_the_last_step_is_evaluated_and_history_carries_it(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    result = pooled_cluster_2.train(**{**RUN, "eval_every": None, "steps": 3})
    assert [e["step"] for e in result.evals] == [3]
    assert "eval" in result.history[-1] and "eval" not in result.history[0]


def test_bad_evaluation_options_are_refused_before_anything_runs(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    base = {k: v for k, v in RUN.items() if k not in ("eval_data", "eval_every", "metrics")}
    cases = [
        ({"eval_every": 2}, "eval_every needs eval_data="),
        ({"metrics": {"acc": logit_square}}, "metrics needs eval_data="),
        ({"eval_data": RUN["eval_data"], "eval_every": 0}, "eval_every must be an integer >= 1"),
        ({"eval_data": RUN["eval_data"], "metrics": {"loss": logit_square}}, "cannot be named"),
        ({"eval_data": RUN["eval_data"], "metrics": {"acc": 3}}, "map names to callables"),
        ({"eval_data": 5}, "eval_data must be a map-style dataset"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            pooled_cluster_2.train(**base, **options)
        with pytest.raises(ValueError, match=message):
            axon_nb.train_local(**base, **options)


def _step_of(name: str) -> int:
    from axon_nb.rank.training import trainstate

    return trainstate.get(name).step


def test_a_metric_that_is_not_a_scalar_fails_before_training_and_loses_nothing(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    base = {k: v for k, v in RUN.items() if k not in ("eval_every", "metrics", "steps")}
    pooled_cluster_2.train(**base, name="kept", steps=2)
    per_token = {"per_token": lambda output, target: output.argmax(-1)}
    with pytest.raises(axon_nb.RankError, match="metric 'per_token' must return a scalar"):
        pooled_cluster_2.train(**base, metrics=per_token, name="kept", resume=True, steps=2)
    with pytest.raises(axon_nb.RankError, match="metric 'per_token' must return a scalar"):
        pooled_cluster_2.train(
            **base, metrics=per_token, name="kept", steps=2, strategy=Pipeline(microbatches=2)
        )
    assert pooled_cluster_2.run(_step_of, "kept") == [
        2,
        2,
    ]  # neither call trained or replaced the run
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]
