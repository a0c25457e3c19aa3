"""The parts that make the loop fast on GPUs, checked where they also run on the CPU: the
per-step agreement read a step late, batches moved ahead, fused optimizers by default, NVML
figures where there are some, a gradient clip that does not wait for the device."""

from __future__ import annotations

import pytest
import torch
from models import make_data, make_mlp, mse

import axon_nb
from axon_nb.metrics.gpu_util import utilization
from axon_nb.rank.data.prefetch import prefetched
from axon_nb.rank.training.agreement import StepAgreement
from axon_nb.rank.training.optimizer_setup import optimizer_factory
from axon_nb.spec.make import make_spec
from axon_nb.strategies import DDP
from axon_nb.widgets.status import status_text


def test_the_agreement_is_read_oldest_first_with_local_values_unreduced() -> None:
    agreement = StepAgreement(world_size=1, device=torch.device("cpu"))
    agreement.post(torch.tensor([1.0, 0.0]), local=torch.tensor([5.0]))
    agreement.post(torch.tensor([2.0, 1.0]), local=torch.tensor([6.0, 7.0]))
    assert len(agreement) == 2
    assert agreement.take() == ([1.0, 0.0], [5.0])
    assert agreement.take() == ([2.0, 1.0], [6.0, 7.0])
    assert len(agreement) == 0


def test_every_step_is_reported_once_in_order_with_its_own_loss() -> None:
    args = dict(model=make_mlp, data=make_data, loss=mse, steps=5, batch_size=16)
    result = axon_nb.train_local(**args, clip_grad_norm=0.1)
    assert [h["step"] for h in result.history] == [1, 2, 3, 4, 5]
    shorter = axon_nb.train_local(**{**args, "steps": 1}, clip_grad_norm=0.1)
    assert shorter.losses == result.losses[:1]  # a one-step run reads its only agreement
    norms = [h["grad_norm"] for h in result.history]
    assert all(isinstance(n, float) and n > 0.1 for n in norms)  # pre-clip norms, each step
    assert [h["grad_norm"] for h in axon_nb.train_local(**args).history] == [None] * 5


def test_batches_come_through_in_order_on_the_device() -> None:
    steps = [[(torch.full((2,), float(i)), {"y": torch.tensor(i)})] for i in range(4)]
    moved = list(prefetched(iter(steps), torch.device("cpu")))
    assert [m[0][0][0].item() for m in moved] == [0.0, 1.0, 2.0, 3.0]
    assert [m[0][1]["y"].item() for m in moved] == [0, 1, 2, 3]
    assert list(prefetched(iter([]), torch.device("cpu"))) == []


def _factory_kwargs(optimizer: object, device: str, **more: object) -> dict[str, object]:
    spec = make_spec(
        DDP, model=make_mlp, data=make_data, optimizer=optimizer, steps=1, batch_size=8, **more
    )
    return optimizer_factory(spec, torch.device(device)).kwargs


def test_adam_and_adamw_are_fused_on_gpus_unless_an_implementation_is_chosen() -> None:
    assert _factory_kwargs(("adamw", {"lr": 1e-3}), "cuda") == {"lr": 1e-3, "fused": True}
    assert _factory_kwargs("adam", "cuda") == {"fused": True}
    assert _factory_kwargs(("adamw", {"foreach": True}), "cuda") == {"foreach": True}
    assert _factory_kwargs(("adamw", {"fused": False}), "cuda") == {"fused": False}
    assert _factory_kwargs("sgd", "cuda") == {}
    assert _factory_kwargs("adamw", "cpu") == {}
    assert _factory_kwargs("adamw", "cuda", mixed_precision="fp16") == {}  # the agreed scaler


def test_nvml_figures_are_absent_where_there_is_no_gpu_and_shown_where_there_are() -> None:
    assert utilization(torch.device("cpu")) == {}
    if not torch.cuda.is_available():
        assert utilization(torch.device("cuda", 0)) == {}  # no driver: no figures, no error
    row = {"rank": 0, "host": "h", "device": "cuda:0", "backend": "nccl", "runs": {},
           "rss_bytes": 1, "cuda_allocated": 2**30, "cuda_total": 80 * 2**30,
           "gpu_util": 97, "memory_bw_util": 41}  # fmt: skip
    assert "1,024 MiB of 81,920 MiB GPU, util 97%, memory bandwidth 41%" in status_text([row])


@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_clipping_scales_to_the_norm_or_leaves_gradients_alone(max_norm: float) -> None:
    from axon_nb.parallel.grads import clip_grad_norm_

    grads = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = clip_grad_norm_(params, max_norm)
    assert norm.item() == pytest.approx(13.0)
    scale = min(1.0, max_norm / 13.0)
    for p, g in zip(params, grads, strict=True):
        assert torch.allclose(p.grad, g * scale, rtol=1e-5)
