"""Hugging Face models and data as their users write them: dict batches, the model's own
loss, token-weighted loss over padded batches, ``datasets`` datasets, eval-mode models.
Each run on two ranks equals ``train_local`` (tiny random-init configs, nothing downloaded)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, ClassVar

import pytest
import torch
from helpers import needs
from hf_models import (
    AugmentedImages,
    FixedTokens,
    TokenRows,
    hf_rows,
    lora_llama,
    pad,
    pretrained_llama,
    tiny_convnext,
    tiny_llama,
    tiny_vit,
)

import axon_nb
from axon_nb import DDP, FSDP

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300), needs("transformers", "datasets")]

STEPS = 12


def shifted_cross_entropy(output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A user's loss on a Mapping batch: ``loss(output, batch)`` (mean over target tokens)."""
    logits = output.logits[:, :-1].flatten(0, 1)
    return torch.nn.functional.cross_entropy(logits, batch["labels"][:, 1:].flatten())


def assert_same_losses(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(want) == STEPS
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert worst < rel, (worst, got, want)


@pytest.mark.parametrize("strategy", [DDP(), FSDP()], ids=["ddp", "fsdp"])
@pytest.mark.parametrize("loss", [None, shifted_cross_entropy], ids=["own-loss", "user-loss"])
def test_padded_dict_batches_weighted_by_tokens_equal_one_process(
    pooled_cluster_2: axon_nb.Cluster, strategy: Any, loss: Any
) -> None:
    run = dict(
        model=tiny_llama, data=TokenRows(), loss=loss, loss_normalization="tokens",
        steps=STEPS, batch_size=8, loader={"collate_fn": pad},
        optimizer=("adamw", {"lr": 1e-2}),
    )  # fmt: skip
    # two ranks of two micro-batches each against one process taking the batch whole:
    # only a mean over the global batch's tokens makes these equal
    result = pooled_cluster_2.train(**run, strategy=strategy, grad_accum=2)
    reference = axon_nb.train_local(**run)
    assert_same_losses(result.losses, reference.losses)
    # the mean of micro-batch means differs on this padded data: the test can fail
    means = axon_nb.train_local(**{**run, "loss_normalization": "mean"}, grad_accum=4)
    assert abs(means.losses[0] - reference.losses[0]) > 1e-3


@pytest.mark.parametrize(
    "form", [{}, {"torch_format": True}, {"streaming": True}], ids=["lists", "torch", "stream"]
)
def test_datasets_datasets_equal_one_process(pooled_cluster_2: axon_nb.Cluster, form: dict) -> None:
    run = dict(model=tiny_llama, data=hf_rows(**form), steps=STEPS, batch_size=8)
    result = pooled_cluster_2.train(**run, optimizer=("adamw", {"lr": 1e-2}))
    reference = axon_nb.train_local(**run, optimizer=("adamw", {"lr": 1e-2}))
    assert_same_losses(result.losses, reference.losses)


def test_a_lora_adapter_trains_under_fsdp_as_in_one_process(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    run = dict(
        model=lora_llama, data=TokenRows(), loss_normalization="tokens", steps=STEPS,
        batch_size=8, loader={"collate_fn": pad}, optimizer=("adamw", {"lr": 1e-2}),
    )  # fmt: skip
    result = pooled_cluster_2.train(**run, strategy=FSDP())
    assert_same_losses(result.losses, axon_nb.train_local(**run).losses)


class _ModeProbe(torch.nn.Module):
    """Records whether each forward ran in training mode."""

    seen: ClassVar[list[bool]] = []

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _ModeProbe.seen.append(self.training)
        return torch.nn.functional.mse_loss(self.linear(x), y)


def test_a_model_given_in_eval_mode_trains_in_training_mode() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    _ModeProbe.seen.clear()
    axon_nb.train_local(model=lambda: _ModeProbe().eval(), data=data, steps=2, batch_size=8)
    assert _ModeProbe.seen == [True, True]
    # from_pretrained's eval mode: dropout is on while training (the loss is not eval's)
    result = axon_nb.train_local(
        model=pretrained_llama, data=TokenRows(), steps=1, batch_size=8,
        loader={"collate_fn": pad}, optimizer=("sgd", {"lr": 0.0}),
    )  # fmt: skip
    batch = pad([TokenRows()[i] for i in range(8)])
    assert result.model.training
    with torch.no_grad():
        eval_loss = result.model.eval()(**batch).loss.item()
    assert eval_loss != pytest.approx(result.losses[0], rel=1e-6)


class _NoLabels(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(8) + i % 4}


def test_a_batch_without_labels_is_refused_at_once_and_the_ranks_stay_usable(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    # checked on the kernel when the dataset is here
    with pytest.raises(ValueError, match=r"keys \['input_ids'\] and no 'labels'"):
        pooled_cluster_2.train(model=tiny_llama, data=_NoLabels(), steps=2, batch_size=4)
    # and on the ranks when it is built there
    with pytest.raises(axon_nb.RankError, match=r"no 'labels' key \(it has \['input_ids'\]\)"):
        pooled_cluster_2.train(model=tiny_llama, data=_NoLabels, steps=2, batch_size=4)
    with pytest.raises(ValueError, match="loss_normalization must be 'mean' or 'tokens'"):
        pooled_cluster_2.train(model=tiny_llama, data=TokenRows, steps=2, batch_size=4,
                               loss_normalization="sum")  # fmt: skip
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]


@dataclasses.dataclass
class _Pair:
    x: torch.Tensor
    note: str


def test_batches_keep_their_structure_when_moved() -> None:
    from transformers import BatchEncoding

    from axon_nb.rank.data.structure import collate, map_tensors

    point = collections.namedtuple("point", "a b")
    batch = {
        "enc": BatchEncoding({"input_ids": torch.ones(2, 3, dtype=torch.long)}),
        "pair": _Pair(torch.zeros(2), "kept"),
        "point": point(torch.ones(1), "id-7"),
        "many": [torch.ones(1), (torch.ones(1), None)],
        "counts": collections.defaultdict(int, {"n": torch.ones(1)}),
    }
    moved = map_tensors(lambda t: t.double(), batch)
    assert isinstance(moved["enc"], BatchEncoding)
    assert moved["enc"]["input_ids"].dtype == torch.float64
    assert moved["pair"].note == "kept" and moved["pair"].x.dtype == torch.float64
    assert moved["point"].b == "id-7" and isinstance(moved["point"], point)
    assert moved["many"][1][1] is None and moved["many"][1][0].dtype == torch.float64
    assert moved["counts"]["n"].dtype == torch.float64
    # lists of token ids stack into [batch, length]
    stacked = collate([{"ids": [1, 2, 3], "text": "a"}, {"ids": [4, 5, 6], "text": "b"}])
    assert stacked["ids"].shape == (2, 3) and stacked["text"] == ["a", "b"]


def _logits(name: str = "model") -> torch.Tensor:
    """(On every rank) the trained run's logits on four fixed rows, in eval mode."""
    from hf_models import TokenRows, pad

    from axon_nb.rank.training import trainstate

    model = trainstate.get(name).model
    with torch.no_grad():
        return model.eval()(**pad([TokenRows()[i] for i in range(4)])).logits


@pytest.mark.parametrize(
    ("make", "strategy"), [("llama", DDP()), ("lora", FSDP())], ids=["llama-ddp", "lora-fsdp"]
)
def test_save_pretrained_loads_back_to_identical_outputs(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Any, make: str, strategy: Any
) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = tiny_llama if make == "llama" else lora_llama
    pooled_cluster_2.train(model=model, data=TokenRows(), steps=3, batch_size=8,
                           strategy=strategy, loader={"collate_fn": pad},
                           optimizer=("adamw", {"lr": 1e-2}))  # fmt: skip
    trained = pooled_cluster_2.run(_logits)[0]
    path = pooled_cluster_2.save(tmp_path / "out", format="hf")
    if make == "llama":
        loaded = LlamaForCausalLM.from_pretrained(path)
    else:
        assert (path / "adapter_config.json").exists() and not (path / "config.json").exists()
        torch.manual_seed(0)  # the base weights the run started from (seed=0)
        loaded = PeftModel.from_pretrained(tiny_llama(), path)
    with torch.no_grad():
        logits = loaded.eval()(**pad([TokenRows()[i] for i in range(4)])).logits
    torch.testing.assert_close(logits, trained, rtol=1e-5, atol=1e-5)
    assert not (logits - pooled_cluster_2.run(_logits)[0]).abs().max() > 1e-5  # the ranks kept it
    with pytest.raises(FileExistsError, match="overwrite=True"):
        pooled_cluster_2.save(path, format="hf")
    assert pooled_cluster_2.save(path, format="hf", overwrite=True) == path


def test_save_pretrained_refuses_a_model_without_it(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Any
) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    pooled_cluster_2.train(model=lambda: torch.nn.Linear(4, 1), data=data,
                           loss=torch.nn.functional.mse_loss, steps=1, batch_size=8)  # fmt: skip
    with pytest.raises(axon_nb.RankError, match="has no save_pretrained"):
        pooled_cluster_2.save(tmp_path / "out", format="hf")
    assert not list(tmp_path.iterdir())  # no partial directory left behind
    with pytest.raises(ValueError, match="format must be 'torch'"):
        pooled_cluster_2.save(tmp_path / "out", format="safetensors")
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]


def _cosine_with_warmup(optimizer: torch.optim.Optimizer) -> Any:
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=STEPS)


def test_a_transformers_scheduler_runs_as_in_one_process(pooled_cluster_2: axon_nb.Cluster) -> None:
    run = dict(
        model=tiny_llama, data=hf_rows(), steps=STEPS, batch_size=8,
        optimizer=("adamw", {"lr": 1e-2}), scheduler=_cosine_with_warmup,
    )  # fmt: skip
    result = pooled_cluster_2.train(**run)
    reference = axon_nb.train_local(**run)
    assert_same_losses(result.losses, reference.losses)
    lrs = [h["lr"] for h in result.history]
    assert lrs[:4] == pytest.approx([0.0, 1e-2 / 3, 2e-2 / 3, 1e-2])  # warm-up, then cosine
    assert lrs[-1] < lrs[4] and lrs == pytest.approx([h["lr"] for h in reference.history])
    with pytest.raises(axon_nb.RankError, match="resume without optimizer lr"):
        pooled_cluster_2.train(resume=True, steps=1, batch_size=8, optimizer=("adamw", {"lr": 1.0}))
    more = pooled_cluster_2.train(resume=True, steps=2, batch_size=8)  # the schedule goes on
    assert [h["step"] for h in more.history] == [STEPS + 1, STEPS + 2]


def test_bad_schedulers_are_refused(pooled_cluster_2: axon_nb.Cluster) -> None:
    with pytest.raises(ValueError, match="scheduler= replaces schedule= and warmup_steps="):
        pooled_cluster_2.train(model=tiny_llama, data=hf_rows(), steps=1, batch_size=8,
                               scheduler=_cosine_with_warmup, warmup_steps=2)  # fmt: skip
    with pytest.raises(axon_nb.RankError, match=r"must return a torch\.optim\.lr_scheduler"):
        pooled_cluster_2.train(model=tiny_llama, data=hf_rows(), steps=1, batch_size=8,
                               scheduler=lambda optimizer: 0.5)  # fmt: skip
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]


def test_tensor_parallel_takes_the_models_own_plan(pooled_cluster_2: axon_nb.Cluster) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from axon_nb import TensorParallel

    run = dict(model=tiny_llama, data=hf_rows(), steps=STEPS, batch_size=8,
               optimizer=("adamw", {"lr": 1e-2}))  # fmt: skip
    reference = axon_nb.train_local(**run)
    # the model's plan: embedding rows, attention and MLP, the head with its output gathered
    result = pooled_cluster_2.train(**run, strategy=TensorParallel(plan="auto"))
    assert_same_losses(result.losses, reference.losses)
    # torch ParallelStyle objects beside style names
    plan = {"model.layers.*.mlp.up_proj": ColwiseParallel(),
            "model.layers.*.mlp.gate_proj": ColwiseParallel(),
            "model.layers.*.mlp.down_proj": RowwiseParallel(),
            "model.layers.*.self_attn.[qkv]_proj": "colwise",
            "model.layers.*.self_attn.o_proj": "rowwise"}  # fmt: skip
    result = pooled_cluster_2.train(**run, strategy=TensorParallel(plan=plan))
    assert_same_losses(result.losses, reference.losses)


def test_sequence_parallel_finds_a_llamas_blocks_and_norms(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """No ``model.blocks`` and no ``nn.RMSNorm``: the layers the plan names are in
    ``model.layers``, its norms are ``LlamaRMSNorm``, and attention takes its hidden states
    by keyword."""
    from axon_nb import TensorParallel

    run = dict(model=tiny_llama, data=FixedTokens(), steps=STEPS, batch_size=8,
               optimizer=("adamw", {"lr": 1e-2}))  # fmt: skip
    result = pooled_cluster_2.train(
        **run, strategy=TensorParallel(plan="auto", sequence_parallel=True)
    )
    assert_same_losses(result.losses, axon_nb.train_local(**run).losses)
    assert pooled_cluster_2.run(_norms_see_half_the_sequence, stream=False) == [[6, 6], [6, 6]]


def _norms_see_half_the_sequence() -> list[int]:
    """(On a rank) the sequence length each block's first norm works on in one forward."""
    from axon_nb.rank.training import trainstate

    model = trainstate.get("model").parallel.root
    seen: list[int] = []
    hooks = [
        layer.input_layernorm.register_forward_hook(
            lambda m, args, out: seen.append(out.to_local().shape[1])
        )
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(torch.randint(1, 64, (2, 12)))
    for hook in hooks:
        hook.remove()
    return seen


def test_a_plan_naming_nothing_names_the_nearest_modules(pooled_cluster_2: axon_nb.Cluster) -> None:
    from axon_nb import TensorParallel

    plan = {"model.layers.*.self_attn.q_projection": "colwise"}
    with pytest.raises(
        axon_nb.RankError,
        match=r"matches no module.*nearest names: model\.layers\.[01]\.self_attn\.q_proj",
    ):
        pooled_cluster_2.train(model=tiny_llama, data=hf_rows(), steps=1, batch_size=8,
                               strategy=TensorParallel(plan=plan))  # fmt: skip
    with pytest.raises(ValueError, match="or is 'auto'"):
        TensorParallel(plan={"lm_head": "diagonal"})
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]


@pytest.mark.parametrize(
    ("model", "strategy"),
    [(tiny_vit, DDP()), (tiny_vit, FSDP()), (tiny_convnext, DDP())],
    ids=["vit-ddp", "vit-fsdp", "convnext-ddp"],
)
def test_image_models_augmented_in_loader_workers_equal_one_process(
    pooled_cluster_2: axon_nb.Cluster, model: Any, strategy: Any
) -> None:
    """Dict batches of ``pixel_values`` and ``labels``, the model's own loss, augmentation in
    two DataLoader workers per rank (the dataset refuses to run anywhere else)."""
    run = dict(
        model=model, data=AugmentedImages(), steps=STEPS, batch_size=8,
        loader={"num_workers": 2}, optimizer=("adamw", {"lr": 1e-2}),
    )  # fmt: skip
    result = pooled_cluster_2.train(**run, strategy=strategy)
    assert_same_losses(result.losses, axon_nb.train_local(**run).losses)
