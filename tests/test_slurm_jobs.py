"""Batch jobs on Slurm: ``axon_nb.submit(launcher="slurm")`` through submitit, on a real
slurmctld with a slurmd on each of two namespaced hosts (no accounting: no ``sacct``), equal to
``train_local``; followed from another process by its Slurm id; preempted by Slurm's notices
(``scancel --signal=USR2``, the time limit's ``--signal``, a higher partition's SIGTERM),
each rank checkpointing at the same step, and resumed (requeued, or ``sbatch`` by hand) to the
uninterrupted run's result. Also an interactive cluster in a Slurm job: the notice stops its
run with a checkpoint, and its ranks live on."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from models import make_data, make_mlp, mse, mse_slow_until, slow_mse
from netns_hosts import IFACE, NetnsHosts
from netns_hosts import missing as hosts_missing
from slurm_local import LocalSlurm
from slurm_local import missing as slurm_missing

import axon_nb
from axon_nb import DDP, FSDP
from axon_nb.errors import AxonError

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        (slurm_missing() or hosts_missing()) is not None,
        reason=f"a private Slurm on namespaced hosts: {slurm_missing() or hosts_missing()}",
    ),
]

ARGS = dict(model=make_mlp, data=make_data(), loss=mse, steps=6, batch_size=32, seed=3)
SLURM = dict(launcher="slurm", ranks=2, nodes=2, iface=IFACE)


@pytest.fixture(scope="module")
def slurm() -> Iterator[LocalSlurm]:
    with NetnsHosts(2) as hosts, LocalSlurm(hosts) as started:
        yield started


def _max_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("strategy", [DDP(), FSDP()], ids=["ddp", "fsdp"])
def test_a_slurm_job_on_two_nodes_trains_as_train_local_and_its_id_finds_it(
    slurm: LocalSlurm, strategy: object, tmp_path: Path
) -> None:
    job = axon_nb.submit(**ARGS, strategy=strategy, **SLURM, job_dir=tmp_path / "job")
    assert job.id.isdigit() and job.id in slurm.jobs()
    result = job.wait(timeout=240)
    assert job.state == "finished"
    reference = axon_nb.train_local(**ARGS)
    assert _max_difference(result.losses, reference.losses) < 1e-5
    logs = " ".join(p.read_text() for p in (job.dir / "slurm").glob("*_log.out"))
    assert all(f"hostname={node}" in logs for node in slurm.nodes)  # a rank on each node
    # readable: the batch script submitit wrote, and the command that submits it again
    sbatch = (job.dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in sbatch and "#SBATCH --signal=USR2@90" in sbatch
    assert "--time" not in sbatch  # (the partition's limit, not submitit's 5 minutes)
    assert f'sbatch --parsable "$@" {job.dir / "job.sbatch"}' in (job.dir / "run.sh").read_text()
    # another process finds it by its Slurm id alone, with no accounting (no sacct here)
    code = (
        "import json, axon_nb\n"
        f"j = axon_nb.job({job.id!r})\n"
        "print(json.dumps([str(j.dir), j.state, len(j.history), j.wait().losses]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == [str(job.dir), "finished", 6, result.losses]


def _when_at_step(job: axon_nb.job.Job | axon_nb.TrainHandle, steps: int) -> float:
    deadline = time.monotonic() + 120
    while len(job.history) < steps:
        if isinstance(job, axon_nb.TrainHandle):
            assert not job.done, "the run ended before the notice"
        else:
            assert job.state in ("submitted", "running"), job.state
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return time.time()


def test_scancel_signal_checkpoints_every_rank_requeues_and_ends_as_if_never_stopped(
    slurm: LocalSlurm, tmp_path: Path
) -> None:
    args = {**ARGS, "loss": slow_mse(0.05), "steps": 40}
    job = axon_nb.submit(**args, strategy=FSDP(), **SLURM, requeue=True, job_dir=tmp_path / "j")
    sent = _when_at_step(job, 8)
    subprocess.run(["scancel", "--signal=USR2", job.id], check=True, timeout=30)
    result = job.wait(timeout=240)
    state = json.loads((job.dir / "state.json").read_text())
    [preempted] = state["preemptions"]
    assert preempted["signal"] == "SIGUSR2" and preempted["saved_at"] - sent < 30
    assert 8 <= preempted["step"] < 40 and state["restarts"] == 1  # (Slurm's own count)
    assert [h["step"] for h in result.history] == list(range(1, 41))
    reference = axon_nb.train_local(**{**ARGS, "steps": 40})
    assert _max_difference(result.losses, reference.losses) < 1e-5


def test_a_higher_partitions_job_preempts_with_sigterm_and_slurm_requeues_it(
    slurm: LocalSlurm, tmp_path: Path
) -> None:
    """Slurm preemption (PreemptMode=REQUEUE): SIGTERM, then KillWait's grace; every rank
    checkpoints at the same step, Slurm requeues the job once the urgent job is done."""
    args = {**ARGS, "loss": slow_mse(0.05), "steps": 40}
    job = axon_nb.submit(**args, **SLURM, requeue=True, job_dir=tmp_path / "spot")
    _when_at_step(job, 8)
    urgent = subprocess.run(
        ["sbatch", "--parsable", "--partition=urgent", "--nodes=2", "--exclusive",
         "--wrap", "sleep 1"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.strip()  # fmt: skip
    result = job.wait(timeout=240)
    state = json.loads((job.dir / "state.json").read_text())
    [preempted] = state["preemptions"]
    assert preempted["signal"] == "SIGTERM" and 8 <= preempted["step"] < 40
    assert urgent not in slurm.jobs()
    reference = axon_nb.train_local(**{**ARGS, "steps": 40})
    assert _max_difference(result.losses, reference.losses) < 1e-5


@pytest.mark.timeout(600)
def test_the_time_limits_notice_checkpoints_and_sbatch_by_hand_resumes(
    slurm: LocalSlurm, tmp_path: Path
) -> None:
    """``--signal=USR2@30`` with a two-minute limit: the notice is due 90 s in, and Slurm may
    send it up to 60 s earlier (``man sbatch``; with one minute it came as the tasks started,
    before they could hold it, and ended them). Without requeue the job ends preempted,
    checkpointed, and ``sh run.sh --time=10`` (``sbatch --time=10 job.sbatch``) submits it
    again under a new id, to the uninterrupted run's result."""
    steps = 2000  # (100 s of sleep alone: more than the first run gets)
    # 50 ms a step for 150 s: past the notice, due 90 s in at the latest; the resumed run,
    # after that, at full speed (on a loaded machine a step took 170 ms)
    args = {**ARGS, "loss": mse_slow_until(time.time() + 150, 0.05), "steps": steps}
    job = axon_nb.submit(**args, **SLURM, time_limit="2", signal_delay_s=30,
                         job_dir=tmp_path / "limit")  # fmt: skip
    first = job.id
    with pytest.raises(AxonError, match=r"was preempted and checkpointed .*run\.sh"):
        job.wait(timeout=240)
    state = json.loads((job.dir / "state.json").read_text())
    [preempted] = state["preemptions"]
    assert job.state == "preempted" and preempted["signal"] == "SIGUSR2"
    assert 0 < preempted["step"] < steps
    done = subprocess.run(
        ["sh", str(job.dir / "run.sh"), "--time=10"], capture_output=True, text=True, timeout=60
    )  # fmt: skip  (by hand, as the README says)
    assert done.returncode == 0, done.stderr
    result = axon_nb.job(job.dir).wait(timeout=300)
    assert job.id != first and job.state == "finished"
    assert [h["step"] for h in result.history] == list(range(1, steps + 1))
    reference = axon_nb.train_local(**{**ARGS, "steps": steps})
    assert _max_difference(result.losses, reference.losses) < 1e-5


def test_cancel_ends_a_slurm_job_and_bad_input_is_refused(
    slurm: LocalSlurm, tmp_path: Path
) -> None:
    job = axon_nb.submit(**{**ARGS, "loss": slow_mse(0.05), "steps": 2000}, **SLURM,
                         job_dir=tmp_path / "c")  # fmt: skip
    _when_at_step(job, 2)
    job.cancel()
    assert job.state == "cancelled" and job.id not in slurm.jobs()
    with pytest.raises(ValueError, match="nodes=3 must be a positive integer that divides"):
        axon_nb.submit(**ARGS, **{**SLURM, "nodes": 3}, job_dir=tmp_path / "bad")
    for limit, delay, message in [
        ("1", 30, r"Slurm may send the notice up to 60 s before it is due .* at least 120 s"),
        ("2:30", None, r"signal_delay_s=90: Slurm may send"),  # (the default delay)
        ("1h", 30, r"time_limit='1h' is not a Slurm time: give minutes"),
    ]:
        with pytest.raises(ValueError, match=message):
            axon_nb.submit(**ARGS, **SLURM, time_limit=limit, signal_delay_s=delay,
                           job_dir=tmp_path / "bad")  # fmt: skip
    with pytest.raises(AxonError, match="Slurm refused the job"):
        axon_nb.submit(**ARGS, **SLURM, partition="nope", job_dir=tmp_path / "refused")
    assert not (tmp_path / "bad").exists()


def test_an_interactive_cluster_in_a_slurm_job_checkpoints_on_the_notice_and_lives_on(
    slurm: LocalSlurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``scancel --signal=USR2`` on the engines' job (as ``--signal=USR2@90`` would): every
    rank stops at the same step and writes its part of a checkpoint; hydra's processes, which
    USR2 would end, ignore it, so the ranks live on and go on from the checkpoint to
    ``train_local``'s result."""
    monkeypatch.chdir(tmp_path)  # (the checkpoint goes to ./axon_checkpoints/<name>)
    cluster = axon_nb.Cluster(n=2, engines="slurm", partition="debug", iface=IFACE,
                              timeout=60, start_timeout=120)  # fmt: skip
    args = {**ARGS, "loss": slow_mse(0.05), "steps": 40}
    with cluster:
        [engines] = slurm.jobs()
        handle = cluster.train(**args, block=False)
        sent = _when_at_step(handle, 8)
        subprocess.run(["scancel", "--signal=USR2", engines], check=True, timeout=30)
        first = handle.wait(timeout=120)
        said = first.preempted
        assert first.stopped and said is not None and said["signal"] == "SIGUSR2"
        assert 8 <= said["step"] < 40 and said["saved_at"] - sent < 30
        assert Path(said["path"]).parent == tmp_path / "axon_checkpoints" / "model"
        cluster.train(**{**args, "steps": 0})  # (a fresh run to load it into)
        cluster.load(said["path"])
        rest = cluster.train(**{**args, "steps": 40 - said["step"]}, resume=True)
    reference = axon_nb.train_local(**{**ARGS, "steps": 40})
    assert _max_difference(first.losses + rest.losses, reference.losses) < 1e-5
