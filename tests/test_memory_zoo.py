"""Peak memory predictions on models no one here wrote, and the promises DDP and ZeRO-2 keep
at the peak (issue 46).

- The held-out part of ``benchmarks/memory_zoo.py``'s zoo: transformers' Llama and ViT and a
  PEFT LoRA adapter (tiny random-init configs), chosen before the memory model's terms were
  set and never used to set them: under DDP, ZeRO-1/2/3 and FSDP (resharding after forward
  or not), with AdamW's for-loop and fused paths, SGD with momentum and bf16 autocast, the
  predicted peak of the largest rank is within 10% of the measured one, and the predicted
  phase held a peak within 10% of it (``peak_by_phase``).
- DDP keeps one copy of the gradients (``gradient_as_bucket_view``): they are views into its
  buckets, and ``DDP(gradient_as_bucket_view=False)`` costs a copy more.
- ZeRO-2 holds at most parameters + gradients/N + one bucket + optimizer state/N +
  activations (with the backward working set), within 10%, for a model of one default
  bucket's size (split into buckets) and for a model of many buckets.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from hf_models import FixedTokens, Pictures, lora_llama, tiny_llama, tiny_vit
from torch import nn

import axon_nb
from axon_nb import DDP, FSDP, ZeRO

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

ADAMW, FUSED = ("adamw", {"lr": 1e-3}), ("adamw", {"lr": 1e-3, "fused": True})
SGD = ("sgd", {"lr": 0.01, "momentum": 0.9})
HELD_OUT = [
    # (model, data, strategies, optimizer, mixed precision)
    (tiny_llama, FixedTokens, [DDP(), ZeRO(stage=1), ZeRO(stage=2), ZeRO(stage=3),
                               FSDP(reshard_after_forward=False)], ADAMW, None),
    (tiny_vit, Pictures, [DDP(), ZeRO(stage=2), FSDP()], SGD, None),
    (lora_llama, FixedTokens, [DDP(), ZeRO(stage=2), FSDP()], FUSED, "bf16"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "data", "strategies", "optimizer", "mixed"), HELD_OUT,
                         ids=["llama", "vit", "lora"])  # fmt: skip
def test_held_out_models_peak_within_10_percent_in_the_predicted_phase(
    pooled_cluster_2: axon_nb.Cluster, model: object, data: object, strategies: list[object],
    optimizer: object, mixed: str | None,
) -> None:  # fmt: skip
    table = pooled_cluster_2.compare(
        strategies, model=model, data=data, batch_size=8, steps=3, warmup=1,
        optimizer=optimizer, mixed_precision=mixed,
    )  # fmt: skip
    print(table)
    for row in table.rows:
        assert row["status"] == "ok", row
        ratio = row["predicted_peak_bytes"] / row["peak_bytes"]
        assert 0.9 <= ratio <= 1.1, (row["strategy"], ratio)
        # The predicted phase held the peak, to the prediction's 10%: forward and backward
        # come within 3-13% of each other on these models, and which one wins by 3% (LoRA
        # under FSDP) differed between CPUs (backward in one CI run, forward here).
        by_phase = row["peak_by_phase"]
        assert by_phase[row["peak_phase"]] == row["peak_bytes"], row
        assert by_phase.get(row["predicted_peak_phase"], 0) >= 0.9 * row["peak_bytes"], row
    assert f"({table.rows[0]['peak_phase']})" in str(table)  # compare shows the phase


def _mlp(widths: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    return nn.Sequential(*layers)


def _vectors() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(128, 256, generator=g),
                                          torch.randint(0, 16, (128,), generator=g))  # fmt: skip


ONE_BUCKET = functools.partial(_mlp, (256, 1024, 1024, 1024, 16))  # 8.4 MiB: under 25 MiB
MANY_BUCKETS = functools.partial(_mlp, (256, *[512] * 9, 16))  # 9 MiB in 1 MiB buckets
RUN = dict(data=_vectors, loss=nn.functional.cross_entropy, batch_size=16, steps=3,
           metrics_interval_s=0, optimizer=SGD)  # fmt: skip


def _promise(cluster: axon_nb.Cluster, model: object, strategy: ZeRO) -> tuple[float, float]:
    """What the ZeRO paper's stage 2 promises a rank: parameters + gradients/N + optimizer
    state/N, plus one bucket (the largest) and the activations with the backward working
    set (from the probe); and the bucket."""
    profile = cluster.profile(model, _vectors, nn.functional.cross_entropy)
    params, largest = profile.params * 4, max(x.largest_param for x in profile.layers) * 4
    bucket = max(min(strategy.bucket_cap_mb * 2**20, params / 4), largest)
    samples = 16 / 2  # a rank's
    activations = sum(x.saved_bytes for x in profile.layers) * samples
    # with the backward working set: activation gradients, the gradient autograd just made
    working = profile.backward_extra_bytes * samples + profile.backward_fixed_bytes + largest
    return params + params / 2 + params / 2 + bucket + activations + working, bucket


@pytest.mark.parametrize(("model", "strategy"), [(ONE_BUCKET, ZeRO(stage=2)),
                         (MANY_BUCKETS, ZeRO(stage=2, bucket_cap_mb=1))],
                         ids=["one-bucket-model", "many-buckets"])  # fmt: skip
def test_zero2_keeps_the_papers_promise_at_the_peak(
    pooled_cluster_2: axon_nb.Cluster, model: object, strategy: ZeRO
) -> None:
    promise, bucket = _promise(pooled_cluster_2, model, strategy)
    zero2 = pooled_cluster_2.train(model=model, strategy=strategy, **RUN)
    ddp = pooled_cluster_2.train(model=model, strategy=DDP(), **RUN)
    peak = max(m["peak_bytes"] for m in zero2.memory)
    assert peak <= 1.1 * promise, (peak / 2**20, promise / 2**20)
    # against DDP it saves what the paper says (half the gradients and of the momentum on 2
    # ranks), less the one bucket
    params = zero2.ranks[0]["memory"]["param_bytes"]
    saved = max(m["peak_bytes"] for m in ddp.memory) - peak
    assert saved >= 0.9 * (params / 2 + params / 2 - bucket), (saved, params, bucket)
    assert zero2.losses == pytest.approx(ddp.losses, rel=1e-5)  # the same training


def _convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip


def _images() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(64, 3, 16, 16, generator=g),
                                          torch.randint(0, 10, (64,), generator=g))  # fmt: skip


LATE = [  # (model, data, strategy, mixed precision): peaks away from the start of backward
    # the largest tensor in the middle: the peak comes when its gradient is made, the later
    # layers' activations gone (and under autocast, their weights' bf16 copies)
    (functools.partial(_mlp, (256, 1024, 1024, 256)), _vectors, ZeRO(stage=2), "bf16"),
    (functools.partial(_mlp, (256, 1024, 1024, 256)), _vectors, FSDP(), "bf16"),
    # the first stage's backward holds its convolutions' activation gradients
    (_convnet, _images, axon_nb.Pipeline(microbatches=4), None),
]


@pytest.mark.parametrize(("model", "data", "strategy", "mixed"), LATE,
                         ids=["zero2-middle", "fsdp-middle", "pipeline-convnet"])  # fmt: skip
def test_peaks_inside_backward_are_predicted_within_10_percent(
    pooled_cluster_2: axon_nb.Cluster,
    model: object,
    data: object,
    strategy: object,
    mixed: str | None,
) -> None:
    [row] = pooled_cluster_2.compare(
        [strategy], model=model, data=data, loss=nn.functional.cross_entropy, batch_size=16,
        steps=3, warmup=1, optimizer=ADAMW, mixed_precision=mixed,
    ).rows  # fmt: skip
    assert row["status"] == "ok", row
    ratio = row["predicted_peak_bytes"] / row["peak_bytes"]
    assert 0.9 <= ratio <= 1.1, ratio


def test_ddp_keeps_one_copy_of_the_gradients(pooled_cluster_2: axon_nb.Cluster) -> None:
    views = pooled_cluster_2.train(model=ONE_BUCKET, strategy=DDP(), **RUN)
    copies = pooled_cluster_2.train(
        model=ONE_BUCKET, strategy=DDP(gradient_as_bucket_view=False), **RUN
    )
    grads = views.ranks[0]["memory"]["param_bytes"]  # as many bytes as the parameters
    parts = views.ranks[0]["memory"]["peak_parts"]
    assert "grads" not in parts and parts["buckets"] == grads  # the gradients are the buckets
    copied = copies.ranks[0]["memory"]["peak_parts"]
    assert copied["grads"] == copied["buckets"] == grads  # a second copy, beside the buckets
    assert views.ranks[0]["memory"]["peak_bytes"] < copies.ranks[0]["memory"]["peak_bytes"]
    assert views.losses == copies.losses  # the same training


def test_a_bad_gradient_as_bucket_view_is_refused() -> None:
    with pytest.raises(ValueError, match="gradient_as_bucket_view must be True or False"):
        DDP(gradient_as_bucket_view="yes")  # type: ignore[arg-type]
