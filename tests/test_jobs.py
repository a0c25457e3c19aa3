"""Batch jobs under torchrun: ``axon_nb.submit`` trains as ``cluster.train`` would (equal to
``train_local``), in a job no kernel holds; any process follows it with ``axon_nb.job``;
``cancel`` ends it; bad input is refused before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers import wait_gone
from models import make_data, make_mlp, mse, slow_mse

import axon_nb
from axon_nb import DDP, FSDP
from axon_nb.errors import AxonError
from axon_nb.spec.kept_runs import output_path

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ARGS = dict(model=make_mlp, data=make_data(), loss=mse, steps=6, batch_size=32, seed=3)


@pytest.mark.parametrize("strategy", [DDP(), FSDP()], ids=["ddp", "fsdp"])
def test_a_torchrun_job_trains_as_train_local_and_any_process_follows_it(
    strategy: object, tmp_path: Path
) -> None:
    job = axon_nb.submit(**ARGS, strategy=strategy, ranks=2, job_dir=tmp_path / "job")
    assert job.id.startswith("local-") and job.dir == (tmp_path / "job").resolve()
    result = job.wait(timeout=240)
    assert job.state == "finished"
    reference = axon_nb.train_local(**ARGS)
    assert max(abs(a - b) for a, b in zip(result.losses, reference.losses, strict=True)) < 1e-5
    assert [h["step"] for h in result.history] == list(range(1, 7))
    # readable: the command, to run again by hand; the directory is the user's alone
    assert (
        "python" in (job.dir / "run.sh").read_text()
        and "-m axon_nb.job" in (job.dir / "run.sh").read_text()
    )
    assert oct(job.dir.stat().st_mode & 0o777) == "0o700"
    # another process (another kernel) finds it, its whole history and its result
    code = (
        "import json, axon_nb\n"
        f"j = axon_nb.job({str(job.dir)!r})\n"
        "print(json.dumps([j.state, len(j.history), j.wait().losses]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    state, steps, losses = json.loads(done.stdout.strip().splitlines()[-1])
    assert (state, steps, losses) == ("finished", 6, result.losses)
    assert job.id in [j.id for j in axon_nb.jobs()]
    assert axon_nb.job(job.id).dir == job.dir  # by its id too


def test_a_job_runs_without_its_kernel_and_cancel_ends_it(tmp_path: Path) -> None:
    args = {**ARGS, "loss": slow_mse(0.05), "steps": 2000}
    job = axon_nb.submit(**args, ranks=2, job_dir=tmp_path / "long")
    while len(job.history) < 3:
        assert job.state in ("submitted", "running"), job.state
        time.sleep(0.05)
    pids = job.pids()
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    assert psutil.Process(pids[0]).ppid() != os.getpid()  # under torchrun, not this process
    job.cancel()
    assert job.state == "cancelled"
    assert wait_gone(pids, 15) == []


def test_a_run_that_streams_nothing_stops_at_once(tmp_path: Path) -> None:
    """``metrics_interval_s=0``: no publication says the ranks began, so ``stop()`` does not
    wait for one (``training_begun.BEGIN_S``, 120 s) before its SIGINT."""
    args = {**ARGS, "loss": slow_mse(0.05, say_at=5, text="AT STEP 5"), "steps": 2000}
    job = axon_nb.submit(**args, ranks=2, metrics_interval_s=0, job_dir=tmp_path / "quiet")
    outputs = [output_path(job.dir, rank) for rank in range(2)]
    deadline = time.monotonic() + 120
    while not all(p.exists() and "AT STEP 5" in p.read_text() for p in outputs):
        assert job.state in ("submitted", "running") and time.monotonic() < deadline, job.state
        time.sleep(0.1)
    started = time.monotonic()
    result = job.stop(timeout=60)
    assert time.monotonic() - started < 60  # (it waited out BEGIN_S before)
    assert 5 <= result.step < 2000 and job.state == "finished", (result.step, job.state)


def test_bad_input_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "bad"
    with monkeypatch.context() as without_slurm:  # (a host with no Slurm: PATH has no sbatch)
        without_slurm.setenv("PATH", str(Path(sys.executable).parent))
        with pytest.raises(AxonError, match=r"needs Slurm's sbatch, srun, .* submit from a Slurm"):
            axon_nb.submit(**ARGS, ranks=2, launcher="slurm", job_dir=target)
    assert not target.exists()
    with pytest.raises(ValueError, match="launcher must be one of torchrun, slurm"):
        axon_nb.submit(**ARGS, ranks=2, launcher="mpirun", job_dir=target)
    with pytest.raises(ValueError, match="partition are Slurm options"):
        axon_nb.submit(**ARGS, ranks=2, partition="debug", job_dir=target)
    lock = threading.Lock()

    def locked_loss(output, target):  # holds a lock: cannot be pickled
        with lock:
            return mse(output, target)

    with pytest.raises(ValueError, match=r"cannot be pickled .*lock"):
        axon_nb.submit(**{**ARGS, "loss": locked_loss}, ranks=2, job_dir=target)
    assert not target.exists()
    with pytest.raises(ValueError, match="invalid training arguments"):
        axon_nb.submit(**{**ARGS, "batch_size": -1}, ranks=2, job_dir=target)
    first = axon_nb.submit(**ARGS, ranks=2, job_dir=target)
    with pytest.raises(AxonError, match="holds another job"):
        axon_nb.submit(**ARGS, ranks=2, job_dir=target)
    first.wait(timeout=240)  # (the first is untouched)
    with pytest.raises(AxonError, match="is not a job's directory"):
        axon_nb.job(tmp_path)
    target.chmod(0o777)  # (others could have written its results: never unpickled)
    with pytest.raises(AxonError, match="is not yours alone"):
        axon_nb.job(target)
    target.chmod(0o700)


def _notice_when_running(job: axon_nb.job.Job, steps: int) -> float:
    """Send the preemption notice (SIGUSR2, as a spot notice or ``scancel --signal``) to
    the job once it has done ``steps`` steps; when it was sent."""
    while len(job.history) < steps:
        assert job.state in ("submitted", "running"), job.state
        time.sleep(0.05)
    sent = time.time()
    os.kill(int(json.loads((job.dir / "state.json").read_text())["supervisor_pid"]),
            signal.SIGUSR2)  # fmt: skip
    return sent


def test_a_preempted_job_checkpoints_requeues_and_ends_as_if_never_stopped(tmp_path: Path) -> None:
    args = {**ARGS, "loss": slow_mse(0.05), "steps": 40}
    job = axon_nb.submit(**args, ranks=2, requeue=True, job_dir=tmp_path / "spot")
    sent = _notice_when_running(job, 8)
    result = job.wait(timeout=240)
    state = json.loads((job.dir / "state.json").read_text())
    [preempted] = state["preemptions"]
    assert preempted["saved_at"] - sent < 30  # within Slurm's default KillWait
    assert (state["state"], state["attempts"]) == ("finished", 2)
    assert 8 <= preempted["step"] < 40
    assert [h["step"] for h in result.history] == list(range(1, 41))  # one whole history
    reference = axon_nb.train_local(**{**ARGS, "steps": 40})
    assert max(abs(a - b) for a, b in zip(result.losses, reference.losses, strict=True)) < 1e-5


def test_a_preempted_job_without_requeue_stops_and_run_sh_resumes_it(tmp_path: Path) -> None:
    args = {**ARGS, "loss": slow_mse(0.05), "steps": 30}
    job = axon_nb.submit(**args, ranks=2, job_dir=tmp_path / "once")
    _notice_when_running(job, 5)
    with pytest.raises(AxonError, match=r"was preempted and checkpointed .*run\.sh"):
        job.wait(timeout=240)
    assert job.state == "preempted" and (job.dir / "checkpoints").is_dir()
    done = subprocess.run(
        ["sh", str(job.dir / "run.sh")], capture_output=True, text=True, timeout=240
    )  # fmt: skip  (by hand, as the README says)
    assert done.returncode == 0, done.stderr[-3000:]
    result = axon_nb.job(job.dir).wait(timeout=60)
    reference = axon_nb.train_local(**{**ARGS, "steps": 30})
    assert max(abs(a - b) for a, b in zip(result.losses, reference.losses, strict=True)) < 1e-5


def test_the_notice_signal_is_checked(tmp_path: Path) -> None:
    for bad in ("USR1", "INT", "TERM", "CHLD", "NOPE"):
        with pytest.raises(ValueError, match=f"preempt_signal='{bad}' cannot be the notice"):
            axon_nb.submit(**ARGS, ranks=2, preempt_signal=bad, job_dir=tmp_path / "x")
    assert not (tmp_path / "x").exists()
