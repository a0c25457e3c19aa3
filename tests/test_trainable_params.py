"""Frozen parameters and optimizer parameter groups under every strategy.

A LoRA-style GPT (embeddings and attention weights frozen) trains with named parameter groups
(``no_decay="bias_and_norm"``, the head at its own learning rate) on two ranks and equals
``train_local``; frozen weights stay bit-identical; only trainable parameters get optimizer
state and gradient communication; checkpoints keep every group's settings from one layout to
the next; the estimator counts gradients, optimizer state and FLOPs of trainable parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from equivalence import full_params
from torch import nn
from torch.utils.data import TensorDataset

import axon_nb
from axon_nb import DDP, FSDP, Pipeline, TensorParallel, ZeRO
from axon_nb.estimate import ModelProfile, predict
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)
STEPS = 12
LR, HEAD_LR, DECAY = 1e-2, 3e-3, 0.1
LOSS_REL = 1e-5
PARAM_TOL = 2e-3  # AdamW at lr 1e-2 magnifies summation-order differences in small gradients


def lora_gpt() -> nn.Module:
    """The reference GPT with a frozen base: its embeddings and attention weights do not
    train (the biases, norms, MLPs and head do)."""
    model = GPT(CONFIG)
    for name, param in model.named_parameters():
        if name.endswith("_emb.weight") or (".attn." in name and name.endswith(".weight")):
            param.requires_grad_(False)
    return model


def tokens() -> TensorDataset:
    return token_dataset(128, block_size=16, vocab_size=64)


def head_rate(name: str, param: Any) -> dict[str, float] | None:
    return {"lr": HEAD_LR} if name.startswith("head.") else None


def adamw(params: Any) -> torch.optim.Optimizer:
    """An optimizer as users write one: a callable over what it is given."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=DECAY)


ARGS: dict[str, Any] = dict(
    model=lora_gpt, data=tokens, loss=lm_loss, steps=STEPS, batch_size=8, seed=0,
    optimizer=("adamw", {"lr": LR, "weight_decay": DECAY}), no_decay="bias_and_norm",
    param_groups=head_rate,
)  # fmt: skip


def settings_of(name: str) -> tuple[float, float]:
    """The (lr, weight_decay) parameter ``name`` must train with."""
    lr = HEAD_LR if name.startswith("head.") else LR
    no_decay = name.endswith(".bias") or ".ln_" in name or name.startswith("ln_f.")
    return lr, 0.0 if no_decay else DECAY


def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in lora_gpt().state_dict().items()}


INITIAL = _initial()
FROZEN = {n for n, p in lora_gpt().named_parameters() if not p.requires_grad}
TRAINABLE = {n for n, p in lora_gpt().named_parameters() if p.requires_grad}
TRAINABLE_BYTES = 4 * sum(p.numel() for p in lora_gpt().parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def reference() -> axon_nb.TrainResult:
    return axon_nb.train_local(**ARGS)


@pytest.fixture(scope="module")
def lora_gpt_profile() -> ModelProfile:
    from axon_nb.rank.observe.model_probe import profile_from

    return ModelProfile.from_dict(profile_from(lora_gpt, tokens, lm_loss))


def _optimizer_view() -> dict[str, Any]:
    """(On every rank) the run's optimizer by parameter name: which parameters have state,
    each one's (lr, weight_decay), and whether every parameter it steps trains."""
    from axon_nb.rank.training import trainstate

    state = trainstate.get("model")
    named = state.parallel.get_state(state.optimizer, full=False)["optimizer"]
    settings = {
        name: (group["lr"], group["weight_decay"])
        for group in named["param_groups"]
        for name in group["params"]
    }
    stepped = [p for g in state.optimizer.param_groups for p in g["params"]]
    return {
        "with_state": sorted(named["state"]),
        "settings": settings,
        "all_train": all(p.requires_grad for p in stepped),
        "lrs": [g["lr"] for g in state.optimizer.param_groups],
        "base_lrs": list(state.scheduler.base_lrs),
    }


def _assert_same_losses(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert worst < LOSS_REL, (worst, got, want)


PIPELINE = Pipeline(microbatches=2, split_points=(1,))  # stage 0: the frozen embedding alone
CASES = [
    (DDP(), "named"), (FSDP(), "named"), (ZeRO(stage=1), "named"), (ZeRO(stage=1), "callable"),
    (ZeRO(stage=2), "callable"), (ZeRO(stage=3), "named"), (TensorParallel(), "named"),
    (PIPELINE, "named"),
]  # fmt: skip
GRADIENTS = {"ddp": "all_reduce", "zero1": "broadcast", "zero2": "reduce_scatter",
             "fsdp": "reduce_scatter"}  # fmt: skip
"""The collective that carries each data-parallel layout's gradients (ZeRO-1: its
updated parameters): its bytes per step are the trainable parameters' and no more."""


@pytest.mark.parametrize(
    ("strategy", "optimizer"), CASES, ids=lambda v: v if isinstance(v, str) else v.describe()
)
def test_a_frozen_base_with_parameter_groups_equals_one_process(
    pooled_cluster_2: axon_nb.Cluster,
    reference: axon_nb.TrainResult,
    lora_gpt_profile: ModelProfile,
    strategy: Any,
    optimizer: str,
) -> None:
    args = {**ARGS, "optimizer": adamw} if optimizer == "callable" else ARGS
    result = pooled_cluster_2.train(**args, strategy=strategy)
    _assert_same_losses(result.losses, reference.losses)
    # frozen weights are bit-identical to the initial ones on every rank; the rest trained
    per_rank = pooled_cluster_2.run(full_params, stream=False)
    for params in per_rank:
        for name in FROZEN:
            assert torch.equal(params[name], INITIAL[name]), name
        for name in TRAINABLE:
            assert not torch.equal(params[name], INITIAL[name]), name
            assert (params[name] - reference.model.state_dict()[name]).abs().max() < PARAM_TOL
    # optimizer state for trainable parameters only, each in its own group's settings
    for view in pooled_cluster_2.run(_optimizer_view, stream=False):
        assert view["with_state"] == sorted(TRAINABLE) and view["all_train"]
        assert view["settings"] == {n: settings_of(n) for n in view["settings"]}
        assert set(view["settings"]) <= TRAINABLE
    # gradient communication and optimizer memory as the estimator predicts them (trainable
    # parameters only), and the gradients' collective carries the trainable bytes alone
    predicted = predict(lora_gpt_profile, strategy, world_size=2, batch_size=8)
    for rank, measured in enumerate(result.ranks):
        comm = {k: v["bytes"] / STEPS for k, v in measured["comm_totals"].items()}
        assert comm == pytest.approx(predicted.ranks[rank]["comm"], rel=0.01)
    # (summed over the ranks: ZeRO-1 balances its shares by whole parameters)
    optimizer_bytes = sum(r["memory"]["optimizer_bytes"] for r in result.ranks)
    expected = sum(r["memory"]["optimizer"] for r in predicted.ranks)
    assert optimizer_bytes == pytest.approx(expected, abs=2048)  # (+ Adam's step counters)
    kind = strategy.config().data_parallel
    if kind in GRADIENTS:
        agreement = 16 if GRADIENTS[kind] == "all_reduce" else 0
        assert comm[GRADIENTS[kind]] == TRAINABLE_BYTES + agreement


def _write_pieces(directory: str) -> None:
    from axon_nb.rank.checkpoint import rescue

    rescue.write_pieces("model", directory)


def _assemble(path: str, partial: str) -> None:
    from axon_nb.rank.checkpoint import rescue
    from axon_nb.spec.checkpoint_format import SaveTarget

    rescue.assemble("model", SaveTarget(path, partial, "full", None), dead=[])


def _groups(path: Path) -> list[list[str]]:
    state = torch.load(path / "state.pt", weights_only=True)
    return [sorted(g["params"]) for g in state["optimizer"]["param_groups"]]


def test_checkpoints_of_every_layout_keep_each_groups_settings(
    pooled_cluster_2: axon_nb.Cluster, reference: axon_nb.TrainResult, tmp_path: Path
) -> None:
    """Three steps in each layout, each continuing from the previous layout's checkpoint:
    the twelve losses are the one-process run's, so every group kept its own rate."""
    losses: list[float] = []
    chain = [
        (ZeRO(stage=1), ARGS["optimizer"], "full"),
        (PIPELINE, ARGS["optimizer"], "full"),
        (FSDP(), ARGS["optimizer"], "sharded"),
        (ZeRO(stage=2), adamw, None),
    ]
    previous = None
    for strategy, optimizer, kind in chain:
        args = {**ARGS, "strategy": strategy, "optimizer": optimizer}
        if previous is not None:
            pooled_cluster_2.train(**{**args, "steps": 0})  # build the run, then load into it
            pooled_cluster_2.load(previous)
        losses += pooled_cluster_2.train(**{**args, "steps": 3}, resume=previous is not None).losses
        if kind is not None:
            previous = tmp_path / f"{strategy.config().data_parallel}-{len(losses)}"
            pooled_cluster_2.save(previous, kind=kind)
        if strategy is PIPELINE:  # a rescue (each stage's pieces put together) too
            pieces = tmp_path / "pieces"
            pieces.mkdir()
            pooled_cluster_2.run(_write_pieces, str(pieces), stream=False)
            pooled_cluster_2.run(_assemble, str(tmp_path / "rescued"), str(pieces), ranks=[0])
    _assert_same_losses(losses, reference.losses)
    ckpt = axon_nb.Checkpoint.read(str(tmp_path / "zero1-3"))
    assert ckpt.trainer["param_groups"][2] == ["head.weight"]
    assert [len(g) for g in _groups(tmp_path / "none-6")] == [22, 4, 1]
    assert _groups(tmp_path / "rescued") == _groups(tmp_path / "none-6")


def test_resume_keeps_each_groups_own_learning_rate(pooled_cluster_2: axon_nb.Cluster) -> None:
    args = {**ARGS, "steps": 1, "strategy": ZeRO(stage=2), "optimizer": adamw}
    pooled_cluster_2.train(**args)
    before = pooled_cluster_2.run(_optimizer_view, stream=False)[0]
    assert before["lrs"] == [LR, LR, HEAD_LR]  # bias/norm, the rest, the head
    new = ("adamw", {"lr": 5e-3, "weight_decay": 0.2})
    pooled_cluster_2.train(**{**args, "optimizer": new}, resume=True)
    after = pooled_cluster_2.run(_optimizer_view, stream=False)[0]
    assert after["lrs"] == after["base_lrs"] == [5e-3, 5e-3, HEAD_LR]  # the head keeps its own
    decays = {settings[1] for name, settings in after["settings"].items() if ".ln_" in name}
    assert decays == {0.0}  # a group's own settings stay; the others take the new ones
    assert after["settings"]["blocks.0.mlp.up.weight"] == (5e-3, 0.2)
    # param_groups given again must group as the run does
    with pytest.raises(axon_nb.RankError, match="group its parameters differently"):
        pooled_cluster_2.train(**{**args, "param_groups": None, "optimizer": None}, resume=True)


def _regrouping(params: Any) -> torch.optim.Optimizer:
    flat = [p for group in params for p in group["params"]]
    return torch.optim.AdamW(flat, lr=LR)


def _all_frozen() -> nn.Module:
    return lora_gpt().requires_grad_(False)


def test_bad_input_is_refused_with_what_to_do(
    tmp_path: Path, pooled_cluster_2: axon_nb.Cluster
) -> None:
    # on the kernel, before anything reaches the ranks
    for bad, match in [
        (dict(param_groups={"lr": 1e-3}), "param_groups must be a callable"),
        (dict(no_decay="biases"), "no_decay must be 'bias_and_norm'"),
        (dict(model=_all_frozen()), "requires_grad=False: there is nothing to train"),
        (dict(model=lora_gpt(), param_groups=lambda n, p: [0.0]), "for 'blocks.0.ln_1.weight'"),
        (dict(model=lora_gpt(), param_groups=lambda n, p: {"params": []}), "by name"),
    ]:
        with pytest.raises(ValueError, match=match):
            pooled_cluster_2.train(**{**ARGS, **bad, "steps": 1})
    # on the ranks, where the model is built
    for bad, match in [
        (dict(model=_all_frozen), "nothing to train"),
        (dict(param_groups=lambda n, p: {"weight_decy": 0.0}), r"\['weight_decy'\].*AdamW"),
        (dict(optimizer=_regrouping, strategy=ZeRO(stage=2)), "must keep them as they are"),
        (dict(optimizer=lambda params: 3), "returned int"),
    ]:
        with pytest.raises(axon_nb.RankError, match=match):
            pooled_cluster_2.train(**{**ARGS, **bad, "steps": 1})
    # a checkpoint grouped otherwise is refused before anything loads
    pooled_cluster_2.train(**{**ARGS, "steps": 1})
    pooled_cluster_2.save(tmp_path / "grouped")
    pooled_cluster_2.train(**{**ARGS, "steps": 0, "param_groups": None})
    with pytest.raises(axon_nb.RankError, match=r"groups parameters differently.*no_decay="):
        pooled_cluster_2.load(tmp_path / "grouped")
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]


def test_the_estimator_counts_trainable_parameters_only(lora_gpt_profile: ModelProfile) -> None:
    whole = ModelProfile.from_dict(
        {
            "layers": [
                {**_row(layer), "frozen": 0, "tp_frozen": 0} for layer in lora_gpt_profile.layers
            ]
        }
    )
    trainable = TRAINABLE_BYTES // 4
    assert lora_gpt_profile.trainable == trainable and whole.trainable == lora_gpt_profile.params
    tokens_per_sample = CONFIG.block_size
    assert (
        lora_gpt_profile.flops == (4 * lora_gpt_profile.params + 2 * trainable) * tokens_per_sample
    )
    memory = predict(lora_gpt_profile, DDP(), world_size=2, batch_size=8).ranks[0]["memory"]
    # (DDP's gradients are views into its buckets: no copy of them beside)
    assert memory["optimizer"] == 8 * trainable and memory["buckets"] == 4 * trainable
    assert memory["grads"] == 0
    assert memory["params"] == 4 * lora_gpt_profile.params
    # the ZeRO formulas: a model's frozen parameters have no gradients or optimizer state
    formula = axon_nb.estimate.memory(lora_gpt(), ZeRO(stage=1), 2)
    assert formula["grads"] == 4 * trainable and formula["optimizer"] == 8 * trainable / 2
    assert formula["params"] == 4 * lora_gpt_profile.params
    # the advisor: DDP fits a device the frozen model fits in and the whole one does not
    frozen_peak = predict(lora_gpt_profile, DDP(), world_size=2, batch_size=8).peak_bytes
    whole_peak = predict(whole, DDP(), world_size=2, batch_size=8).peak_bytes
    assert frozen_peak < whole_peak
    device = (frozen_peak + whole_peak) / 2
    fits = [
        axon_nb.advise(profile=p, world_size=2, device_memory=device, batch_size=8,
                       strategies=[DDP()]).rows[0]["fits"]
        for p in (lora_gpt_profile, whole)
    ]  # fmt: skip
    assert fits == [True, False]


def _row(layer: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(layer)


PEAK_CONFIG = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=32)
"""tests/test_predictions.py's GPT, where activations do not dwarf the parameters."""


def lora_gpt_for_peak() -> nn.Module:
    """``PEAK_CONFIG``'s GPT frozen as :func:`lora_gpt` freezes: over a third of it frozen."""
    model = GPT(PEAK_CONFIG)
    for name, param in model.named_parameters():
        if name.endswith("_emb.weight") or (".attn." in name and name.endswith(".weight")):
            param.requires_grad_(False)
    return model


def test_a_frozen_base_s_predicted_peak_is_within_ten_percent_of_measured(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """Counting gradients and Adam state for frozen parameters would put the prediction
    well above the measured peak; counting trainable ones only puts it within 10%."""
    table = pooled_cluster_2.compare(
        [DDP(), ZeRO(stage=1), ZeRO(stage=2), FSDP()],
        model=lora_gpt_for_peak,
        data=lambda: token_dataset(256, block_size=32, vocab_size=256),
        loss=lm_loss, batch_size=16, optimizer=("adamw", {"lr": 1e-3}), steps=3, warmup=1,
    )  # fmt: skip
    model = lora_gpt_for_peak()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen > sum(p.numel() for p in model.parameters()) / 3
    for row in table.rows:
        assert row["status"] == "ok", row
        ratio = row["predicted_peak_bytes"] / row["peak_bytes"]
        assert 0.9 <= ratio <= 1.1, (row["strategy"], ratio)
