"""Checkpoints: save -> load -> continue equals an uninterrupted run, bit for bit; sharded
checkpoints reshard between 2 and 4 ranks; interrupted writes are never taken for complete;
bad input changes nothing. Real clusters, gloo."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

import axon_nb
from axon_nb import DDP, FSDP, Hybrid, Pipeline, TensorParallel, ZeRO
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset
from axon_nb.spec.checkpoint_format import MARKER, Checkpoint, plan_save

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ARGS: dict[str, Any] = dict(
    model=lambda: GPT(GPTConfig()),
    data=token_dataset,
    loss=lm_loss,  # what model(x, y) computes; pipelines need it as a function
    batch_size=32,
    optimizer=("adamw", {"lr": 3e-3}),
    seed=0,
)
LOSS_TOL = 1e-5


def _state(name: str) -> dict[str, Any]:
    """Run ``name``'s full model and optimizer state, gathered (rank 0's copy is complete)."""
    from axon_nb.rank.training import trainstate

    state = trainstate.get(name)
    return {"step": state.step, **state.parallel.get_state(state.optimizer, full=True)}


def _assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for name, entry in a["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b["optimizer"]["state"][name][key]), (name, key)


def _train(cluster: axon_nb.Cluster, strategy: Any, steps: int, name: str, **kw: Any) -> Any:
    return cluster.train(**ARGS, strategy=strategy, steps=steps, name=name, **kw)


@pytest.mark.parametrize(
    ("strategy", "kind"),
    [
        (FSDP(), "sharded"),
        (FSDP(), "full"),
        (FSDP(sharding="shard_grad_op"), "sharded"),
        (ZeRO(stage=1), "full"),
        (ZeRO(stage=2), "sharded"),
        (DDP(), "sharded"),
        (TensorParallel(), "sharded"),
        (TensorParallel(sequence_parallel=True), "full"),
        (Pipeline(), "sharded"),
        (Pipeline(schedule="gpipe"), "full"),
    ],
    ids=["fsdp-sharded", "fsdp-full", "shard_grad_op-sharded", "zero1-full", "zero2-sharded",
         "ddp-sharded", "tp-sharded", "tp+sp-full", "pipeline-sharded", "gpipe-full"],
)  # fmt: skip
def test_save_load_continue_equals_an_uninterrupted_run(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path, strategy: Any, kind: str
) -> None:
    _round_trip(pooled_cluster_2, tmp_path / "ckpt", strategy, kind)


@pytest.mark.parametrize(
    ("strategy", "kind"),
    [(Hybrid(dp=2, pp=2, microbatches=2), "sharded"), (Hybrid(tp=2, pp=2), "full")],
    ids=["dp2xpp2-sharded", "tp2xpp2-full"],
)
def test_hybrid_runs_resume_bit_for_bit(
    pooled_cluster_4: axon_nb.Cluster, tmp_path: Path, strategy: Any, kind: str
) -> None:
    _round_trip(pooled_cluster_4, tmp_path / "ckpt", strategy, kind)


def _round_trip(cluster: axon_nb.Cluster, path: Path, strategy: Any, kind: str) -> None:
    """Train 6 steps, save, train 6 more; then load into a fresh run and train the same 6."""
    _train(cluster, strategy, 6, "a")
    saved = cluster.save(path, kind, name="a")
    assert (saved.kind, saved.step, saved.world_size, saved.name) == (
        kind, 6, len(cluster.ranks), "a"
    )  # fmt: skip
    uninterrupted = _train(cluster, strategy, 6, "a", resume=True)

    _train(cluster, strategy, 0, "b")  # a fresh run to load into
    assert cluster.load(path, name="b").step == 6
    resumed = _train(cluster, strategy, 6, "b", resume=True)

    assert resumed.start_step == 6
    assert resumed.losses == uninterrupted.losses  # bit for bit
    a, b = (cluster.run(_state, n, stream=False)[0] for n in ("a", "b"))
    _assert_same_state(a, b)


@pytest.mark.parametrize(
    ("strategy", "kind"),
    [(FSDP(), "sharded"), (ZeRO(stage=2), "sharded"), (FSDP(), "full"), (Pipeline(), "sharded")],
    ids=["fsdp-sharded", "zero2-sharded", "fsdp-full", "pipeline-sharded"],
)
def test_checkpoints_load_on_another_world_size(
    pooled_cluster_2: axon_nb.Cluster,
    pooled_cluster_4: axon_nb.Cluster,
    tmp_path: Path,
    strategy: Any,
    kind: str,
) -> None:
    for source, target in (
        (pooled_cluster_2, pooled_cluster_4),
        (pooled_cluster_4, pooled_cluster_2),
    ):
        path = tmp_path / f"from{len(source.ranks)}"
        _train(source, strategy, 5, "a")
        source.save(path, kind, name="a")
        saved = source.run(_state, "a", stream=False)[0]

        _train(target, strategy, 0, "b")
        target.load(path, name="b")
        loaded = target.run(_state, "b", stream=False)[0]
        _assert_same_state(saved, loaded)  # resharding keeps every value

        # The same global batches on 2 or 4 ranks: equal up to summation order.
        there = _train(source, strategy, 4, "a", resume=True)
        here = _train(target, strategy, 4, "b", resume=True)
        assert max(abs(x - y) for x, y in zip(there.losses, here.losses, strict=True)) < LOSS_TOL


def _fail_at(step: str) -> None:
    """Make this rank's next save raise at ``step``: ``"_complete"`` (every part is written,
    no marker yet) or ``"_move_in"`` (the old checkpoint was just renamed aside)."""
    from axon_nb.rank.checkpoint import checkpoint_io

    def crash(*args: Any) -> None:
        raise OSError("disk full (injected)")

    setattr(checkpoint_io, step, crash)


def _restore_save() -> None:
    import importlib

    from axon_nb.rank.checkpoint import checkpoint_io

    importlib.reload(checkpoint_io)  # its functions as written


def test_a_failed_save_removes_its_partial_directory_and_keeps_the_old_checkpoint(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    _train(pooled_cluster_2, FSDP(), 3, "a")
    pooled_cluster_2.save(path, "sharded", name="a")
    _train(pooled_cluster_2, FSDP(), 2, "a", resume=True)
    pooled_cluster_2.run(_fail_at, "_complete", stream=False)
    try:
        with pytest.raises(axon_nb.RankError, match="disk full"):
            pooled_cluster_2.save(path, "sharded", name="a", overwrite=True)
        with pytest.raises(axon_nb.RankError, match="disk full"):
            pooled_cluster_2.save(tmp_path / "other", "full", name="a")
    finally:
        pooled_cluster_2.run(_restore_save, stream=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no partial directory left
    assert Checkpoint.read(path).step == 3  # the one it was to replace is untouched
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        pooled_cluster_2.load(tmp_path / "other", name="a")
    _train(pooled_cluster_2, FSDP(), 0, "b")
    assert pooled_cluster_2.load(path, name="b").step == 3


def test_an_interrupted_write_is_never_taken_for_complete(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    """The kernel died during the save, so nobody removed the partial directory."""
    from axon_nb.rank import entry

    path = tmp_path / "ckpt"
    _train(pooled_cluster_2, FSDP(), 2, "a")
    target = plan_save(path, "sharded", overwrite=False)
    target.create_partial()
    pooled_cluster_2.run(_fail_at, "_complete", stream=False)
    try:
        ar = pooled_cluster_2.send(entry.save_checkpoint, "a", target).ar
        with pytest.raises(Exception, match="disk full"):
            ar.get(timeout=120)
    finally:
        pooled_cluster_2.run(_restore_save, stream=False)
    assert (Path(target.partial) / ".metadata").exists()  # every part, no marker
    with pytest.raises(FileNotFoundError, match="never completed: its write was interrupted"):
        pooled_cluster_2.load(path, name="a")
    with pytest.raises(ValueError, match=f"not a complete axon_nb checkpoint: it has no {MARKER}"):
        Checkpoint.read(target.partial)


def test_a_crash_between_the_renames_still_finds_a_complete_checkpoint(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    _train(pooled_cluster_2, DDP(), 3, "a")
    pooled_cluster_2.save(path, "full", name="a")
    _train(pooled_cluster_2, DDP(), 2, "a", resume=True)
    pooled_cluster_2.run(_fail_at, "_move_in", stream=False)
    try:
        with pytest.raises(axon_nb.RankError, match="disk full"):
            pooled_cluster_2.save(path, "full", name="a", overwrite=True)
    finally:
        pooled_cluster_2.run(_restore_save, stream=False)
    # Nothing at the path: the old checkpoint is aside, the new one complete in its partial.
    assert not path.exists()
    (old,) = tmp_path.glob("ckpt.old-*")
    (new,) = tmp_path.glob("ckpt.partial-*")
    with pytest.warns(UserWarning, match=f"complete checkpoint beside it, {re.escape(str(new))}"):
        found = Checkpoint.read(path)
    assert (found.path, found.step) == (str(new), 5)  # the most recently completed one
    _train(pooled_cluster_2, DDP(), 0, "b")
    with pytest.warns(UserWarning, match="nothing is at"):
        assert pooled_cluster_2.load(path, name="b").step == 5
    shutil.rmtree(new)
    with pytest.warns(UserWarning, match=f"beside it, {re.escape(str(old))}"):
        assert Checkpoint.read(path).step == 3


def _someone_creates(what: str) -> None:
    """Just before this rank completes its next save, someone else puts a directory at its
    path (replacing what was there): ``"empty"``, or ``"files"`` holding theirs.txt."""
    from axon_nb.rank.checkpoint import checkpoint_io

    complete = checkpoint_io._complete

    def racing(meta: Any, target: Any) -> None:
        if os.path.isdir(target.path):
            shutil.rmtree(target.path)
        os.mkdir(target.path)
        if what == "files":
            Path(target.path, "theirs.txt").write_text("not yours")
        complete(meta, target)

    checkpoint_io._complete = racing


def test_what_appears_at_the_path_during_a_save_is_left_alone(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    _train(pooled_cluster_2, DDP(), 2, "a")
    for what, overwrite in (("empty", False), ("files", True)):
        path = tmp_path / what
        if overwrite:
            pooled_cluster_2.save(path, "sharded", name="a")
        pooled_cluster_2.run(_someone_creates, what, stream=False)
        try:
            with pytest.raises(
                axon_nb.RankError,
                match=f"something else appeared at {re.escape(str(path))} while the "
                "checkpoint was being written .*; it was left untouched",
            ) as e:
                pooled_cluster_2.save(path, "sharded", name="a", overwrite=overwrite)
        finally:
            pooled_cluster_2.run(_restore_save, stream=False)
        theirs = {"empty": [], "files": ["theirs.txt"]}[what]
        assert sorted(p.name for p in path.iterdir()) == theirs
        if what == "files":
            assert (path / "theirs.txt").read_text() == "not yours"
        kept = re.search(r"complete in (\S+\.partial-[0-9a-f]+)", str(e.value))
        assert kept is not None
        assert Checkpoint.read(kept.group(1)).step == 2
        assert pooled_cluster_2.load(kept.group(1), name="a").step == 2


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_checkpoints_are_owner_only_unless_asked_otherwise(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    _train(pooled_cluster_2, DDP(), 1, "a")
    for kind in ("full", "sharded"):
        path = tmp_path / kind
        pooled_cluster_2.save(path, kind, name="a")
        pooled_cluster_2.save(path, kind, name="a", overwrite=True)  # a replacement too
        files = list(path.iterdir())
        assert MARKER in {f.name for f in files} and len(files) >= 2
        assert _mode(path) == 0o700
        assert {f.name: _mode(f) for f in files} == {f.name: 0o600 for f in files}
    umask = os.umask(0o022)  # the ranks inherited this process's umask when they started
    os.umask(umask)
    shared = tmp_path / "shared"
    pooled_cluster_2.save(shared, "sharded", name="a", private=False)
    assert _mode(shared) == 0o777 & ~umask
    assert {_mode(f) for f in shared.iterdir()} == {0o666 & ~umask}


def _exec(code: str) -> Any:
    """An object whose unpickling runs ``code``."""

    class Exec:
        def __reduce__(self) -> Any:
            return (exec, (code,))

    return Exec()


def test_a_planted_metadata_file_is_refused_and_never_run(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    path, pwned = tmp_path / "ckpt", tmp_path / "pwned"
    _train(pooled_cluster_2, FSDP(), 2, "a")
    pooled_cluster_2.save(path, "sharded", name="a")
    planted = pickle.dumps(_exec(f"open({str(pwned)!r}, 'w').close()"))
    (path / ".metadata").write_bytes(planted)
    before = pooled_cluster_2.run(_state, "a", stream=False)[0]
    with pytest.raises(
        axon_nb.RankError,
        match=r"the checkpoint's \.metadata references builtins\.exec, which a checkpoint "
        r"never needs; it was not loaded \(it may have been tampered with\)",
    ):
        pooled_cluster_2.load(path, name="a")
    assert not pwned.exists()
    _assert_same_state(before, pooled_cluster_2.run(_state, "a", stream=False)[0])
    pickle.loads(planted)  # what plain unpickling (DCP's own reader) would have done
    assert pwned.exists()


def test_sharded_entries_that_are_not_plain_data_are_refused(tmp_path: Path) -> None:
    """DCP pickles non-tensor entries (an optimizer's lr, betas) and unpickles them with
    plain pickle; SafeReader loads plain values only, and those the same as before."""
    import torch.distributed.checkpoint as dcp

    from axon_nb.rank.checkpoint.safe_reader import SafeReader, UnsafeCheckpointError

    plain = {"w": torch.arange(4.0), "lr": 3e-3, "betas": (0.9, 0.95), "groups": [{"n": None}]}
    dcp.save(plain, checkpoint_id=tmp_path / "plain")
    loaded = {"w": torch.zeros(4), "lr": 0.0, "betas": (0.0, 0.0), "groups": [{"n": 1}]}
    dcp.load(loaded, storage_reader=SafeReader(tmp_path / "plain"))
    assert torch.equal(loaded.pop("w"), plain.pop("w")) and loaded == plain

    pwned = tmp_path / "pwned"
    dcp.save({"w": torch.ones(2), "lr": _exec(f"open({str(pwned)!r}, 'w').close()")},
             checkpoint_id=tmp_path / "bad")  # fmt: skip
    target = {"w": torch.zeros(2), "lr": 0.0}
    refused = "entry 'lr' references exec, which a checkpoint never needs; it was not loaded"
    with pytest.raises(UnsafeCheckpointError, match=refused):
        SafeReader(tmp_path / "bad").check()
    with pytest.raises(dcp.CheckpointException, match=refused):  # a BaseException
        dcp.load(target, storage_reader=SafeReader(tmp_path / "bad"))
    assert not pwned.exists() and torch.equal(target["w"], torch.zeros(2))
    dcp.load(target, checkpoint_id=tmp_path / "bad")  # DCP's own reader runs it
    assert pwned.exists()


def _params(name: str) -> dict[str, torch.Tensor]:
    from axon_nb.rank.training import trainstate

    state = trainstate.get(name)
    return {k: v.detach().clone() for k, v in state.parallel.full_state_dict().items()}


def test_bad_checkpoint_input_changes_nothing(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    _train(pooled_cluster_2, DDP(), 2, "a")
    pooled_cluster_2.save(path, "sharded", name="a")
    with pytest.raises(FileExistsError, match="pass overwrite=True to replace it"):
        pooled_cluster_2.save(path, "sharded", name="a")
    with pytest.raises(ValueError, match="kind must be 'full' or 'sharded'"):
        pooled_cluster_2.save(tmp_path / "x", "zip", name="a")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        pooled_cluster_2.load(tmp_path / "nowhere", name="a")
    with pytest.raises(axon_nb.RankError, match=r"no training run named 'c'.*steps=0"):
        pooled_cluster_2.load(path, name="c")
    with pytest.raises(axon_nb.RankError, match="no training run named 'c' on this rank to save"):
        pooled_cluster_2.save(tmp_path / "y", name="c")

    # A different model: nothing is loaded, the run keeps its parameters.
    pooled_cluster_2.train(
        **{**ARGS, "model": lambda: GPT(GPTConfig(n_embd=48))}, steps=1, name="wide"
    )
    before = pooled_cluster_2.run(_params, "wide", stream=False)[0]
    with pytest.raises(axon_nb.RankError, match="does not fit run 'wide'") as e:
        pooled_cluster_2.load(path, name="wide")
    assert "different shapes (checkpoint vs model)" in str(e.value)
    assert "Nothing was loaded; the run is unchanged" in str(e.value)
    after = pooled_cluster_2.run(_params, "wide", stream=False)[0]
    assert all(torch.equal(before[k], after[k]) for k in before)

    # The same model with another optimizer.
    pooled_cluster_2.train(
        **{**ARGS, "optimizer": ("sgd", {"lr": 0.1})}, strategy=DDP(), steps=1, name="s"
    )
    with pytest.raises(
        axon_nb.RankError, match="the checkpoint's optimizer is AdamW, this run's SGD"
    ):
        pooled_cluster_2.load(path, name="s")


class _Payload:
    """Not a tensor: unpickling it would run code, which weights_only loading refuses."""

    def __reduce__(self) -> Any:
        return (os.getcwd, ())


def test_full_checkpoints_load_tensors_only(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    _train(pooled_cluster_2, DDP(), 1, "a")
    pooled_cluster_2.save(path, "full", name="a")
    blob = torch.load(path / "state.pt", weights_only=True)
    torch.save({**blob, "model": _Payload()}, path / "state.pt")
    with pytest.raises(axon_nb.RankError, match="Weights only load failed"):
        pooled_cluster_2.load(path, name="a")
    meta = json.loads((path / MARKER).read_text())
    assert meta["kind"] == "full" and meta["world_size"] == 2
