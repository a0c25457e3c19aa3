"""The supervisor of a batch job on this host (``python -m axon_nb.job JOB_DIR``): it runs the
job's ranks under torchrun, records the job's state, cancels them on SIGTERM, passes a
preemption notice (``USR2`` by default) on to every rank, and with ``requeue`` relaunches
them after they checkpointed on one (they go on from the checkpoint).

Example (what ``run.sh`` in the job's directory holds)::

    python -m axon_nb.job /home/me/jobs/model-20261129-0612
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from axon_nb.spec.job_files import read_job, read_json, write_state

_cancelled = False
_ranks: subprocess.Popen[bytes] | None = None
"""The running torchrun."""


def rank_command(job_dir: str, ranks: int) -> list[str]:
    """The torchrun command that starts the job's ``ranks`` ranks on this host."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
        f"--nproc-per-node={ranks}", "-m", "axon_nb.rank.job_rank", job_dir,
    ]  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not read_job(argv[0]):
        print("usage: python -m axon_nb.job JOB_DIR (a directory axon_nb.submit made)",
              file=sys.stderr)  # fmt: skip
        return 2
    job_dir = str(Path(argv[0]).resolve())
    job = read_job(job_dir)
    notice = getattr(signal, f"SIG{str(job.get('preempt_signal', 'USR2')).upper()}")
    signal.signal(notice, lambda signum, frame: _forward(job_dir, signum))
    signal.signal(signal.SIGTERM, lambda signum, frame: _cancel(job_dir))
    attempt = 0
    preemptions: list[dict[str, object]] = []
    while True:
        attempt += 1
        code, preempted = _launch(job_dir, job, attempt)
        if preempted is not None:
            preemptions.append(preempted)
            write_state(job_dir, "running", preemptions=preemptions)
        if _cancelled:
            state = "cancelled"
        elif preempted and job.get("requeue"):
            write_state(job_dir, "requeued", attempts=attempt)
            continue  # (relaunched: the ranks go on from the checkpoint)
        else:
            state = "preempted" if preempted else "finished" if code == 0 else "failed"
        write_state(job_dir, state, exit_code=code, attempts=attempt)
        return 0 if code == 0 else 1


def note_resubmitted(argv: list[str]) -> int:
    """``JOB_DIR SLURM_ID``: the job was submitted again (``sh run.sh``); it waits as
    ``submitted`` under its new id until its tasks start."""
    if len(argv) != 2 or not read_job(argv[0]) or not argv[1].isdigit():
        print("usage: python -m axon_nb.job --submitted JOB_DIR SLURM_JOB_ID", file=sys.stderr)
        return 2
    from axon_nb.job.job_index import index_job

    write_state(argv[0], "submitted", slurm_job_id=argv[1], cancel_requested=False)
    index_job(argv[1], Path(argv[0]).resolve())  # (axon_nb.job(id) finds it by its new id)
    print(f"Submitted batch job {argv[1]}")
    return 0


def _launch(
    job_dir: str, job: dict[str, object], attempt: int
) -> tuple[int, dict[str, object] | None]:
    """Run the ranks once; their exit code, and what they said when they checkpointed on a
    notice (the step, when the notice came and when the checkpoint was complete)."""
    global _ranks
    marker = Path(job_dir) / "preempted.json"
    marker.unlink(missing_ok=True)
    with open(Path(job_dir) / "supervisor.log", "ab") as log:
        _ranks = subprocess.Popen(
            rank_command(job_dir, int(str(job["ranks"]))), stdin=subprocess.DEVNULL,
            stdout=log, stderr=log, cwd=str(job.get("cwd") or "") or None,
            start_new_session=True,
        )  # fmt: skip
    write_state(job_dir, "running", supervisor_pid=os.getpid(), torchrun_pid=_ranks.pid,
                attempt=attempt)  # fmt: skip
    code = _ranks.wait()
    said = read_json(marker) if marker.exists() else None
    marker.unlink(missing_ok=True)
    return code, said


def rank_pids(torchrun_pid: int) -> list[int]:
    """The job's rank processes under torchrun."""
    try:
        children = psutil.Process(torchrun_pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            if "axon_nb.rank.job_rank" in " ".join(child.cmdline()):
                found.append(child.pid)
    return sorted(found)


def _forward(job_dir: str, signum: int) -> None:
    """A preemption notice: to every rank (each checkpoints at the same step)."""
    if _ranks is not None:
        for pid in rank_pids(_ranks.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)


def _cancel(job_dir: str) -> None:
    global _cancelled
    _cancelled = True
    if _ranks is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(_ranks.pid, signal.SIGTERM)  # torchrun ends its ranks
