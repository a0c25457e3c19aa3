"""``resume=True`` with another strategy moves a run to the new layout in memory (model,
optimizer state, step, learning-rate schedule, data position) and continues it exactly: the
continued run equals one uninterrupted ``train_local`` run of the same steps within 1e-5,
for every pair of strategies on 2 ranks and pipeline/hybrid pairs on 4. The switch holds at
most one extra copy of the run's state; a layout the model cannot take changes nothing."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest

import axon_nb
from axon_nb import DDP, FSDP, Hybrid, Pipeline, TensorParallel, ZeRO
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

CONFIG = GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16)
RUN: dict[str, Any] = dict(
    model=functools.partial(GPT, CONFIG),
    data=functools.partial(token_dataset, 512, block_size=16, vocab_size=64),
    loss=lm_loss,
    batch_size=16,
    optimizer=("adamw", {"lr": 3e-3, "weight_decay": 0.1}),
    warmup_steps=8,  # the switch comes mid warm-up: the schedule must continue exactly
    clip_grad_norm=1.0,
)
FIRST, THEN = 5, 7


@functools.cache
def reference() -> list[float]:
    return axon_nb.train_local(**RUN, steps=FIRST + THEN).losses


def _continue(cluster: axon_nb.Cluster, before: Any, after: Any) -> list[float]:
    first = cluster.train(**RUN, strategy=before, steps=FIRST, name="run")
    then = cluster.train(**RUN, strategy=after, steps=THEN, resume=True, name="run")
    assert then.layout_change is not None
    assert (then.layout_change["from"], then.layout_change["to"]) == (
        before.describe(),
        after.describe(),
    )
    assert then.start_step == FIRST and then.step == FIRST + THEN
    return first.losses + then.losses


def _equal(losses: list[float]) -> None:
    want = reference()
    assert len(losses) == len(want) == 12
    for step, (got, ref) in enumerate(zip(losses, want, strict=True), 1):
        assert got == pytest.approx(ref, rel=1e-5), f"step {step}: {got} != {ref}"


TWO_RANKS = [
    DDP(), FSDP(), FSDP(sharding="shard_grad_op"), ZeRO(stage=1), ZeRO(stage=2),
    TensorParallel(), Pipeline(microbatches=2),
]  # fmt: skip
PAIRS = [(a, b) for a, b in itertools.permutations(TWO_RANKS, 2)]


@pytest.mark.parametrize(("before", "after"), PAIRS, ids=lambda s: s.describe())
def test_every_pair_continues_as_if_never_switched(
    pooled_cluster_2: axon_nb.Cluster, before: Any, after: Any
) -> None:
    _equal(_continue(pooled_cluster_2, before, after))


FOUR_PAIRS = [
    (DDP(), Hybrid(dp=2, pp=2)),
    (Hybrid(dp=2, pp=2), FSDP()),
    (Hybrid(dp=2, tp=2), Hybrid(tp=2, pp=2)),
    (Pipeline(microbatches=4), Hybrid(dp=2, tp=2)),
    (ZeRO(stage=3), Pipeline(microbatches=4)),
]


@pytest.mark.parametrize(("before", "after"), FOUR_PAIRS, ids=lambda s: s.describe())
def test_pipeline_and_hybrid_pairs_on_four_ranks(
    pooled_cluster_4: axon_nb.Cluster, before: Any, after: Any
) -> None:
    _equal(_continue(pooled_cluster_4, before, after))


def _switch_memory(name: str) -> dict[str, int]:
    """On a rank: move run ``name`` from its layout to FSDP() under a tracker that counts the
    old state's storage until it is freed and every new storage until it is."""
    from axon_nb.metrics.peak import PeakTracker
    from axon_nb.rank import runtime
    from axon_nb.rank.training import trainstate
    from axon_nb.rank.training.relayout import relayout
    from axon_nb.spec.make import make_spec

    state = trainstate.get(name)
    full = state.parallel.get_state(state.optimizer, full=True, every_rank=True)
    size = sum(t.numel() * t.element_size() for t in _tensors(full))
    del full
    old = [*state.module.state_dict().values(), *_tensors(state.optimizer.state_dict())]
    spec = make_spec(
        DDP, model=functools.partial(GPT, CONFIG), data=None, strategy=FSDP(), steps=0,
        batch_size=16, resume=True, name=name,
    )  # fmt: skip
    tracker = PeakTracker()
    with tracker:
        for tensor in old:
            tracker._track(tensor)
        held = tracker.current
        del old
        relayout(spec, runtime.context(), state)
    return {"held": held, "peak": tracker.peak, "state": size}


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def test_the_switch_holds_at_most_one_extra_copy_and_says_how_long(
    pooled_cluster_2: axon_nb.Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    pooled_cluster_2.train(**RUN, strategy=DDP(), steps=2, name="big")
    for figures in pooled_cluster_2.run(_switch_memory, "big", stream=False):
        extra = figures["peak"] - figures["held"]
        assert figures["held"] >= 0.9 * figures["state"]  # DDP holds the whole state
        assert extra <= 1.05 * figures["state"], figures
    pooled_cluster_2.train(**RUN, strategy=ZeRO(stage=2), steps=1, name="big", resume=True)
    assert "Resharded 'big' from FSDP() to ZeRO(stage=2) in " in capsys.readouterr().out


def test_a_layout_the_model_cannot_take_changes_nothing(pooled_cluster_2: axon_nb.Cluster) -> None:
    first = pooled_cluster_2.train(**RUN, strategy=DDP(), steps=FIRST, name="run")
    cut = Pipeline(microbatches=2, split_points=(9,))  # GPT here has 6 layers: no such cut
    with pytest.raises(axon_nb.RankError):
        pooled_cluster_2.train(**RUN, strategy=cut, steps=THEN, resume=True, name="run")
    then = pooled_cluster_2.train(**RUN, strategy=DDP(), steps=THEN, resume=True, name="run")
    _equal(first.losses + then.losses)  # the run went on under DDP as if nothing happened


def test_bad_switches_are_refused_with_what_to_do(pooled_cluster_2: axon_nb.Cluster) -> None:
    pooled_cluster_2.train(**RUN, strategy=FSDP(), steps=1, name="run")
    with pytest.raises(ValueError, match="must multiply to the world size"):
        pooled_cluster_2.train(**RUN, strategy=Hybrid(dp=2, tp=2), steps=1, resume=True, name="run")
    without_model = {k: v for k, v in RUN.items() if k != "model"}
    with pytest.raises(axon_nb.RankError, match="pass the model again with resume=True"):
        pooled_cluster_2.train(**without_model, strategy=DDP(), steps=1, resume=True, name="run")
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]


def test_another_number_of_ranks_points_to_save_and_load() -> None:
    """A run lives in the ranks' memory: after a restart with other ranks the error says so
    and names cluster.save / cluster.load."""
    with axon_nb.Cluster(n=2, timeout=120) as cluster:
        cluster.train(**RUN, strategy=DDP(), steps=1, name="run")
        cluster.restart(n=1)
        with pytest.raises(axon_nb.RankError, match=r"does not survive a restart.*cluster\.save"):
            cluster.train(**RUN, strategy=DDP(), steps=1, resume=True, name="run")


def _step_of(name: str) -> int:
    from axon_nb.rank.training import trainstate

    return trainstate.get(name).step


def test_compare_from_state_starts_every_candidate_from_the_run(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    pooled_cluster_2.train(**RUN, strategy=DDP(), steps=FIRST, name="model")
    table = pooled_cluster_2.compare(
        [FSDP(), ZeRO(stage=2), Pipeline(microbatches=2)], **RUN, steps=3, warmup=1,
        from_state=True,
    )  # fmt: skip
    for row in table.rows:
        assert row["status"] == "ok", row
        # three steps on from step 5: the uninterrupted run's step 8
        assert row["loss"] == pytest.approx(reference()[FIRST + 2], rel=1e-5), row
    assert pooled_cluster_2.run(_step_of, "model", stream=False) == [FIRST, FIRST]  # left as it was


def test_a_scheduler_that_is_no_lr_scheduler_is_refused_when_switching(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """A run with its own scheduler= builds it again for the new layout's optimizer: one that
    does not return an LRScheduler is refused there as for a fresh run, before the old layout
    is let go, so the run goes on as if the call had not happened."""
    import torch

    run = {k: v for k, v in RUN.items() if k != "warmup_steps"}
    halving = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)
    first = pooled_cluster_2.train(**run, scheduler=halving, strategy=DDP(), steps=3, name="own")
    again = {**run, "optimizer": ("adamw", {"weight_decay": 0.1})}  # (its scheduler sets lr)
    with pytest.raises(
        axon_nb.RankError, match=r"scheduler= must return a torch\.optim\.lr_scheduler\.LRScheduler"
    ):
        pooled_cluster_2.train(**again, scheduler=lambda optimizer: 0.5, strategy=FSDP(), steps=2,
                               resume=True, name="own")  # fmt: skip
    then = pooled_cluster_2.train(
        **again, scheduler=halving, strategy=FSDP(), steps=2, resume=True, name="own"
    )
    assert then.layout_change is not None and then.start_step == 3
    want = axon_nb.train_local(**run, scheduler=halving, steps=5).losses
    got = first.losses + then.losses
    assert got == pytest.approx(want, rel=1e-5)
    assert [h["lr"] for h in then.history] == pytest.approx([1.5e-3, 7.5e-4])
