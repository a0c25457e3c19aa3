"""``cluster.predict``: the outputs of the model the ranks hold for every item, in data order,
under its own strategy, equal to the single-process model's within 1e-5; to files with
``output_dir``; bad input refused before anything runs."""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
from hf_models import FixedTokens, tiny_llama

import axon_nb
from axon_nb import DDP, FSDP, Hybrid, Pipeline, TensorParallel, ZeRO
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ROWS = 37  # 2 ranks x batch 5 does not divide it
CONFIG = GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16)
RUN: dict[str, Any] = dict(
    model=functools.partial(GPT, CONFIG),
    data=functools.partial(token_dataset, 64, block_size=16, vocab_size=64),
    loss=lm_loss,
    steps=2,
    batch_size=16,
)
TEST = token_dataset(ROWS, block_size=16, vocab_size=64, seed=3)


def _full_model(name: str = "model") -> dict[str, torch.Tensor]:
    from axon_nb.rank.training import trainstate

    return trainstate.get(name).parallel.full_state_dict()


def _reference(cluster: axon_nb.Cluster) -> torch.Tensor:
    model = GPT(CONFIG)
    model.load_state_dict(cluster.run(_full_model, stream=False)[0])
    model.eval()
    with torch.no_grad():
        return model(TEST.tensors[0])


TWO_RANKS = [DDP(), FSDP(), ZeRO(stage=2), TensorParallel(), Pipeline(microbatches=2)]


@pytest.mark.parametrize("strategy", TWO_RANKS, ids=str)
def test_outputs_equal_one_process_in_data_order(
    pooled_cluster_2: axon_nb.Cluster, strategy: Any
) -> None:
    pooled_cluster_2.train(**RUN, strategy=strategy)
    got = pooled_cluster_2.predict(TEST, batch_size=5)
    want = _reference(pooled_cluster_2)
    assert got.shape == want.shape == (ROWS, 16, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]


@pytest.mark.parametrize("strategy", [Hybrid(dp=2, pp=2), Hybrid(dp=2, tp=2)], ids=str)
def test_four_rank_layouts_predict_in_data_order(
    pooled_cluster_4: axon_nb.Cluster, strategy: Any
) -> None:
    pooled_cluster_4.train(**RUN, strategy=strategy)
    torch.testing.assert_close(
        pooled_cluster_4.predict(TEST, batch_size=3),
        _reference(pooled_cluster_4),
        rtol=1e-5,
        atol=1e-5,
    )


def test_a_llama_returns_its_model_output_with_logits(pooled_cluster_2: axon_nb.Cluster) -> None:
    data = FixedTokens(count=ROWS)
    pooled_cluster_2.train(tiny_llama, FixedTokens(), strategy=FSDP(), steps=2, batch_size=8)
    got = pooled_cluster_2.predict(data, batch_size=4)
    model = tiny_llama()
    model.load_state_dict(pooled_cluster_2.run(_full_model, stream=False)[0])
    model.eval()
    with torch.no_grad():
        want = model(input_ids=data.ids, labels=data.ids)
    assert type(got).__name__ == type(want).__name__  # CausalLMOutputWithPast
    assert got.past_key_values is None and got.loss is None  # no rows: left out
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_output_dir_keeps_the_rows_in_files(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Any
) -> None:
    pooled_cluster_2.train(**RUN, strategy=DDP())
    files = pooled_cluster_2.predict(TEST, batch_size=5, output_dir=tmp_path)
    assert [os.path.basename(f) for f in files] == [
        "predictions-00000-of-00002.pt",
        "predictions-00001-of-00002.pt",
    ]
    rows = torch.empty(ROWS, 16, 64)
    for path in files:
        part = torch.load(path)
        rows[part["indices"]] = part["outputs"]
    torch.testing.assert_close(rows, _reference(pooled_cluster_2), rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_and_the_model_stays(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Any
) -> None:
    pooled_cluster_2.train(**RUN, strategy=DDP())
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        pooled_cluster_2.predict(TEST, batch_size=0)
    with pytest.raises(ValueError, match="is not a directory"):
        pooled_cluster_2.predict(TEST, batch_size=4, output_dir=tmp_path / "missing")
    with pytest.raises(axon_nb.RankError, match="nothing"):
        pooled_cluster_2.predict(TEST, batch_size=4, name="nothing")
    with pytest.raises(axon_nb.RankError, match="predict at least one sample per rank"):
        pooled_cluster_2.predict(torch.utils.data.Subset(TEST, [0]), batch_size=4)
    assert pooled_cluster_2.predict(TEST, batch_size=8).shape == (ROWS, 16, 64)


def test_train_local_outputs_are_the_reference() -> None:
    """The loss check of the reference itself: the trained model predicts what it trained on
    better than a fresh one (the comparison above is not between two untrained models)."""
    result = axon_nb.train_local(**{**RUN, "steps": 30}, optimizer=("adamw", {"lr": 3e-3}))
    x, y = TEST.tensors
    with torch.no_grad():
        assert lm_loss(result.model.eval()(x), y) < lm_loss(GPT(CONFIG).eval()(x), y)
