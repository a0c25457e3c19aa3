"""The run the resize tests move between worlds (``tests/test_resize.py``, and across hosts
``tests/test_hosts.py``), its one-process reference and the check against it."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import pytest
import torch
from equivalence import full_params

import axon_nb
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
RUN: dict[str, Any] = dict(
    model=functools.partial(GPT, CONFIG),
    data=functools.partial(token_dataset, 512, block_size=16, vocab_size=64),
    loss=lm_loss,
    batch_size=16,  # the global batch: 8 a rank on 2 ranks, 4 on 4
    optimizer=("adamw", {"lr": 3e-3, "weight_decay": 0.1}),
    warmup_steps=8,  # the resize comes mid warm-up: the schedule must go on exactly
    clip_grad_norm=1.0,
)
STEPS = 24


def slow_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``lm_loss``, 80 ms slower: the resize comes while the run is still training."""
    time.sleep(0.08)
    return lm_loss(output, target)


def held_while(path: str):  # type: ignore[no-untyped-def]
    """``lm_loss`` that waits while the file ``path`` exists (at most 120 s): the run stays in
    progress until the test removes it, however fast or slow the machine (CI once finished a
    run of six 80 ms steps before the test's next call)."""

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        deadline = time.monotonic() + 120
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        return lm_loss(output, target)

    return loss


def slow_until_resized(old: int):  # type: ignore[no-untyped-def]
    """``lm_loss``, 0.5 s slower while the world still has ``old`` ranks: the resize's stop
    lands mid-run however slow the machine (CI's 2 loaded cores once let 21 steps of
    ``slow_loss`` finish before it), and the steps after it cost nothing more."""

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if torch.distributed.get_world_size() == old:
            time.sleep(0.5)
        return lm_loss(output, target)

    return loss


@functools.cache
def reference(steps: int = STEPS) -> axon_nb.TrainResult:
    return axon_nb.train_local(**RUN, steps=steps)


def world_sizes(cluster: axon_nb.Cluster) -> list[int]:
    return cluster.run(lambda: torch.distributed.get_world_size(), stream=False)


def equal_to_reference(cluster: axon_nb.Cluster, result: axon_nb.TrainResult) -> None:
    want = reference()
    assert [h["step"] for h in result.history] == list(range(1, STEPS + 1))
    for step, (got, ref) in enumerate(zip(result.losses, want.losses, strict=True), 1):
        assert got == pytest.approx(ref, rel=1e-5), f"step {step}: {got} != {ref}"
    params = cluster.run(full_params, stream=False)
    for name, value in want.model.state_dict().items():
        assert all(torch.equal(params[0][name], other[name]) for other in params[1:]), name
        if name.endswith("attn.k.bias"):
            # Its gradient is 0 in exact arithmetic (softmax ignores a shift of every score),
            # so AdamW steps it by lr along rounding noise, whose sign follows the order of
            # each world's reductions: it is compared across ranks only.
            continue
        assert (params[0][name] - value).abs().max().item() < 1e-5, name


def resize_during_run(
    cluster: axon_nb.Cluster, strategy: Any, new: int, train: Any = None, **resize: Any
) -> tuple[axon_nb.TrainResult, dict[str, Any]]:
    """Train :data:`RUN` with ``strategy`` (and the options ``train``, ``block=False``),
    resize to ``new`` ranks once it has done 3 steps and wait for its end: its result
    (checked to equal the reference) and what the resize said."""
    old = len(cluster.ranks)
    handle = cluster.train(**{**RUN, "loss": slow_until_resized(old)}, strategy=strategy,
                           steps=STEPS, metrics_interval_s=0.1, block=False,
                           **(train or {}))  # fmt: skip
    while len(handle.history) < 3:
        time.sleep(0.02)
    changed = cluster.resize(new, **resize)
    assert (changed["from"], changed["to"], changed["moved"]) == (old, new, "model")
    assert 3 <= changed["step"] < STEPS, changed  # (it came while the run trained)
    result = handle.wait()
    assert [(r["from"], r["to"], r["step"]) for r in result.resizes] == [
        (old, new, changed["step"])
    ]
    assert result.start_step == 0 and result.step == STEPS and len(result.ranks) == new
    assert result.layout_change is not None and result.layout_change["world_size"] == [old, new]
    equal_to_reference(cluster, result)
    assert world_sizes(cluster) == [new] * new
    assert [r["rank"] for r in cluster.ranks] == list(range(new))
    return result, changed
