"""``cluster.resize(n)`` (``%axon_cluster --resize N``) adds or removes ranks of a live
cluster: new engines start in a second launch and the world re-forms at the new size. A run
in progress (``block=False``) stops at a step boundary, moves to the new world in memory and
goes on with its global batch, so the whole run equals ``train_local`` at 1e-5 under DDP,
FSDP and ZeRO-1/2/3, growing and shrinking; between calls ``train(resume=True)`` goes on at
the new size. What cannot be kept is refused before anything changes, or dropped by name.
(Across hosts: ``tests/test_hosts.py``.)"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import pytest
import torch
from equivalence import full_params
from IPython.core.error import UsageError

import axon_nb
from axon_nb import DDP, FSDP, DiLoCo, Hybrid, ZeRO
from axon_nb.cluster.host_fit import usable_cores
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

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


@functools.cache
def reference(steps: int = STEPS) -> axon_nb.TrainResult:
    return axon_nb.train_local(**RUN, steps=steps)


@pytest.fixture(scope="module")
def cluster(shell: Any) -> Any:
    """A cluster of this module's own (it changes size), started by the magic."""
    shell.run_line_magic("axon_cluster", "2 --timeout 60")
    started = shell.magics_manager.registry["AxonMagics"].cluster
    yield started
    shell.run_line_magic("axon_cluster", "--stop")


def _resized_to(cluster: axon_nb.Cluster, n: int) -> None:
    if len(cluster.ranks) != n:
        cluster.resize(n)


def _world(cluster: axon_nb.Cluster) -> list[int]:
    return cluster.run(lambda: torch.distributed.get_world_size(), stream=False)


def _equal_to_reference(cluster: axon_nb.Cluster, result: axon_nb.TrainResult) -> None:
    want = reference()
    assert [h["step"] for h in result.history] == list(range(1, STEPS + 1))
    for step, (got, ref) in enumerate(zip(result.losses, want.losses, strict=True), 1):
        assert got == pytest.approx(ref, rel=1e-5), f"step {step}: {got} != {ref}"
    params = cluster.run(full_params, stream=False)
    for name, value in want.model.state_dict().items():
        if name.endswith("attn.k.bias"):
            # Its gradient is 0 in exact arithmetic (softmax ignores a shift of every score),
            # so AdamW steps it by lr along rounding noise, whose sign follows the order of
            # each world's reductions: it is compared below across ranks only.
            continue
        assert (params[0][name] - value).abs().max().item() < 1e-5, name
        assert all(torch.equal(params[0][name], other[name]) for other in params[1:]), name


STRATEGIES = [DDP(), FSDP(), ZeRO(stage=1), ZeRO(stage=2), ZeRO(stage=3)]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.describe())
def test_a_run_goes_on_through_a_resize_as_train_local(cluster: Any, strategy: Any) -> None:
    old = len(cluster.ranks)
    new = 4 if old == 2 else 2  # grows, then shrinks, then grows ...
    handle = cluster.train(**{**RUN, "loss": slow_loss}, strategy=strategy, steps=STEPS,
                           metrics_interval_s=0.1, block=False)  # fmt: skip
    while len(handle.history) < 3:
        time.sleep(0.02)
    changed = cluster.resize(new)
    assert (changed["from"], changed["to"], changed["moved"]) == (old, new, "model")
    assert 3 <= changed["step"] < STEPS, changed  # (it came while the run trained)
    result = handle.wait()
    assert [(r["from"], r["to"], r["step"]) for r in result.resizes] == [
        (old, new, changed["step"])
    ]
    assert result.start_step == 0 and result.step == STEPS and len(result.ranks) == new
    assert result.layout_change is not None and result.layout_change["world_size"] == [old, new]
    _equal_to_reference(cluster, result)
    assert _world(cluster) == [new] * new
    assert [r["rank"] for r in cluster.ranks] == list(range(new))
    assert cluster.options.n == new
    # The dashboard: the ranks that joined or left, and the run on through them.
    state = result.dashboard.state
    moved = f"{old} -> {new} ranks"
    assert any(moved in note for note in state.notes), state.notes
    statuses = [row["status"] for row in state.snapshot()["ranks"]]
    if new < old:
        assert statuses == ["finished"] * new + ["left"] * (old - new)
    else:
        assert statuses == ["finished"] * new
    assert state.steps[-1] == STEPS


def test_between_calls_train_resume_goes_on_at_the_new_size(cluster: Any, capsys: Any) -> None:
    _resized_to(cluster, 2)
    cluster.train(**RUN, steps=1, name="other")
    first = cluster.train(**RUN, steps=5)  # the latest run: it moves
    cluster.execute(
        "import torch\nimport torch.distributed as dist\n"
        "group = dist.new_group(list(range(world_size)))\n"
        "wrapped = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
        "plain = torch.nn.Linear(2, 2)\n",
        stream=False,
    )
    capsys.readouterr()
    changed = cluster.resize(4)
    said = capsys.readouterr().err
    assert changed["moved"] == "model" and changed["runs"] == ["other"]
    assert changed["objects"] == ["group", "wrapped"]
    assert "Dropped the runs kept on the old world: other" in said, said
    assert "group, wrapped" in said and "ranks 2-3 joined" in said, said
    held = cluster.run(_names, ("group", "wrapped", "plain"), stream=False)
    assert held == [["plain"], ["plain"], [], []]  # (ranks 2 and 3 never had one)
    then = cluster.train(**RUN, steps=7, resume=True)
    assert then.layout_change is not None and then.layout_change["to"] == "DDP() · 4 ranks"
    want = reference(12).losses
    for got, ref in zip(first.losses + then.losses, want, strict=True):
        assert got == pytest.approx(ref, rel=1e-5)
    with pytest.raises(axon_nb.RankError, match="no training run named 'other'"):
        cluster.train(**RUN, steps=1, resume=True, name="other")


def test_bad_resizes_are_refused_before_anything_changes(cluster: Any) -> None:
    _resized_to(cluster, 2)
    cluster.train(**RUN, steps=2)
    before = [dict(r) for r in cluster.ranks]
    for bad in (0, -1, 2.5, True, "four"):
        with pytest.raises(ValueError, match="positive integer"):
            cluster.resize(bad)
    with pytest.raises(ValueError, match="batch_size=16"):
        cluster.resize(3)  # 16 samples do not split over 3 ranks
    with pytest.raises(ValueError, match="across hosts"):
        cluster.resize(add_hosts="elsewhere:2")
    strict = dataclasses.replace(cluster.options, oversubscribe=False)
    cluster.options, kept = strict, cluster.options
    try:
        with pytest.raises(ValueError, match="cores"):
            cluster.resize(usable_cores() + 1)
    finally:
        cluster.options = kept
    cluster.train(**{**RUN, "batch_size": 4}, strategy=Hybrid(tp=2), steps=1, name="tp")
    with pytest.raises(ValueError, match="'tp'"):
        cluster.resize(3)  # tensor parallel over 2 does not divide 3 ranks
    cluster.train(**RUN, strategy=DiLoCo(inner_steps=2), steps=2, name="outer")
    with pytest.raises(ValueError, match="outer loop"):
        cluster.resize(4)
    # A run in progress on a stream goes on, untouched.
    handle = cluster.train(**{**RUN, "loss": slow_loss, "data": _stream()}, steps=6,
                           block=False, name="stream")  # fmt: skip
    with pytest.raises(ValueError, match="stream"):
        cluster.resize(4)
    assert handle.wait().step == 6 and not handle.wait().resizes
    assert cluster.ranks == before and _world(cluster) == [2, 2]


def _names(names: tuple[str, ...]) -> list[str]:
    """(On a rank) which of ``names`` its namespace holds."""
    from IPython import get_ipython

    return [name for name in names if name in get_ipython().user_ns]


class _Tokens(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        yield from token_dataset(512, block_size=16, vocab_size=64)


def _stream() -> _Tokens:
    return _Tokens()


def test_the_magic_resizes_and_says_what_changed(cluster: Any, shell: Any, capsys: Any) -> None:
    _resized_to(cluster, 2)
    shell.run_line_magic("axon_cluster", "--resize 4")
    out = capsys.readouterr()
    assert "from 2 to 4 ranks" in out.err and "ranks 2-3 joined" in out.err
    assert len(out.out.strip().splitlines()) == 5  # the table: a header and 4 ranks
    with pytest.raises(UsageError, match="batch_size=16"):  # (the latest run's batch)
        shell.run_line_magic("axon_cluster", "--resize 3")
    shell.run_line_magic("axon_cluster", "--resize 2")
    assert "ranks 2-3 left" in capsys.readouterr().err
    with pytest.raises(UsageError, match="number of ranks"):
        shell.run_line_magic("axon_cluster", "--resize many")
    assert _world(cluster) == [2, 2]
