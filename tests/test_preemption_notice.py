"""A detached cluster's run takes the preemption notice (a spot notice: SIGUSR2 to any one
rank): every rank stops at the same step and writes its part of a checkpoint, the ranks live
on, and the run goes on from it to ``train_local``'s result. A bad notice signal is refused."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from models import make_data, make_mlp, mse, slow_mse

import axon_nb

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

ARGS = dict(model=make_mlp, data=make_data(), loss=mse, steps=30, batch_size=32, seed=5)


def test_a_detached_clusters_run_checkpoints_on_a_notice_to_one_rank(tmp_path: Path) -> None:
    cluster = axon_nb.Cluster(n=2, detach=True, name=f"notice-{os.getpid()}")
    args = {**ARGS, "loss": slow_mse(0.05)}
    with cluster:
        handle = cluster.train(**args, block=False, checkpoint_dir=str(tmp_path / "ck"),
                               checkpoint_every=1000)  # fmt: skip
        deadline = time.monotonic() + 60
        while len(handle.history) < 6:
            assert not handle.done and time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(cluster.ranks[1]["pid"], signal.SIGUSR2)  # (one rank's notice stops all)
        first = handle.wait(timeout=120)
        said = first.preempted
        assert first.stopped and said is not None and said["signal"] == "SIGUSR2"
        assert 6 <= said["step"] < 30 and Path(said["path"]).parent == tmp_path / "ck"
        os.kill(cluster.ranks[0]["pid"], signal.SIGUSR2)  # (between runs: ignored)
        cluster.train(**{**args, "steps": 0})
        cluster.load(said["path"])
        rest = cluster.train(**{**args, "steps": 30 - said["step"]}, resume=True)
    reference = axon_nb.train_local(**ARGS)
    losses = first.losses + rest.losses
    assert max(abs(a - b) for a, b in zip(losses, reference.losses, strict=True)) < 1e-5


def test_a_notice_signal_that_is_taken_is_refused(shell: InteractiveShell) -> None:
    for bad, why in (("TERM", "axon_nb's stop of a rank"), ("USR1", "stack-dump"),
                     ("CHLD", "USR2 \\(the default\\) or one of URG"),
                     ("NOPE", "USR2 \\(the default\\)")):  # fmt: skip
        with pytest.raises(ValueError, match=f"preempt_signal='{bad}' cannot be the notice.*{why}"):
            axon_nb.Cluster(n=2, preempt_signal=bad)
    assert axon_nb.Cluster(n=2, preempt_signal="sigurg").options.preempt_signal == "URG"
    with pytest.raises(UsageError, match="preempt_signal='INT' cannot be the notice"):
        shell.run_line_magic("axon_cluster", "2 --preempt-signal INT")
