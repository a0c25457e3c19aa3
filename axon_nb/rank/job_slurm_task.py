"""(Rank) one task of a Slurm batch job (``axon_nb.submit(launcher="slurm")``): what submitit
runs in each of the job's tasks. It describes the world as torchrun would (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``... from Slurm's variables), runs the rank as a torchrun job's
(``rank/job_rank.py``), and on rank 0 records the job's state in its directory.

Preemption: submitit's own handler (checkpoint on rank 0, requeue while the others run on)
is replaced by axon_nb's: on the notice signal (``--signal=USR2@90`` before the time limit,
``scancel --signal=USR2``) or SIGTERM (Slurm preemption, then KillWait's grace) every rank
finishes the step in flight and checkpoints; then, when the job was submitted with ``requeue=True``,
rank 0 asks the batch script to requeue it (``scontrol requeue``, once every task ended: a
preempted job that ends within its GraceTime would otherwise end COMPLETED, not requeued).

Example (what the job's ``submitted.pkl`` calls in every task)::

    run_task("/home/me/axon_jobs/model-20261129-0612-ab12")
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from axon_nb.rank import job_rank
from axon_nb.rank.preemption import hold_notices
from axon_nb.spec.job_files import (
    PREEMPTED_EXIT,
    read_job,
    read_json,
    read_state,
    requeue_marker,
    write_state,
)


def run_task(job_dir: str) -> int:
    """Run this task's rank of the job in ``job_dir``; its exit code (0, or
    ``PREEMPTED_EXIT`` after a notice)."""
    # submitit's handlers go (SIGUSR2 ignored if it is not the notice); a notice before
    # training began is kept for the run (rank/job_rank.py holds it), SIGTERM ends the task
    # until then (a cancel)
    job = read_job(job_dir)
    for signum in (signal.SIGTERM, signal.SIGCONT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    hold_notices(str(job.get("preempt_signal", "USR2")))
    _describe_world(job)
    rank, job_id = int(os.environ["RANK"]), os.environ["SLURM_JOB_ID"]
    if rank == 0:  # (the batch script's setup removed a requeue marker left by a past run)
        (Path(job_dir) / "preempted.json").unlink(missing_ok=True)
        write_state(job_dir, "running", slurm_job_id=job_id,
                    restarts=int(os.environ.get("SLURM_RESTART_COUNT", "0")))  # fmt: skip
    try:
        code = job_rank.main(job_dir, batch=True)
    except BaseException as e:  # (rank 0 alone writes the state; the others say it in output)
        if rank == 0:
            write_state(job_dir, "failed", error=f"rank {rank}: {type(e).__name__}: {e}")
        raise
    if rank == 0:
        _record_end(job_dir, job, code)
    return code


def _record_end(job_dir: str, job: dict[str, object], code: int) -> None:
    """Rank 0, once every rank is done: the job's state, and the requeue after a notice."""
    if code != PREEMPTED_EXIT:
        write_state(job_dir, "finished", exit_code=code)
        return
    said = read_json(Path(job_dir) / "preempted.json")
    state = read_state(job_dir)
    preemptions = [*state.get("preemptions", []), said]
    if state.get("cancel_requested"):
        write_state(job_dir, "cancelled", preemptions=preemptions)
    elif job.get("requeue"):  # (the batch script requeues once every task ended)
        write_state(job_dir, "requeued", preemptions=preemptions)
        requeue_marker(job_dir).touch()
    else:
        write_state(job_dir, "preempted", preemptions=preemptions)


def _describe_world(job: dict[str, object]) -> None:
    """torchrun's variables, from Slurm's; the first node hosts the rendezvous."""
    env = os.environ
    nodes = subprocess.run(
        ["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()  # fmt: skip
    restarts = int(env.get("SLURM_RESTART_COUNT", "0"))
    env.update(
        RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"], LOCAL_RANK=env["SLURM_LOCALID"],
        LOCAL_WORLD_SIZE=str(tasks_on_node(env["SLURM_TASKS_PER_NODE"], int(env["SLURM_NODEID"]))),
        MASTER_ADDR=nodes[0], MASTER_PORT=str(rendezvous_port(int(env["SLURM_JOB_ID"]), restarts)),
    )  # fmt: skip
    iface = job.get("iface")
    if iface:  # gloo and NCCL listen and connect on this network only
        env.setdefault("GLOO_SOCKET_IFNAME", str(iface))
        env.setdefault("NCCL_SOCKET_IFNAME", str(iface))


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """The tasks on node ``node`` from ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``: 2 on each of
    the first three nodes, then 1)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if found is None:
            raise ValueError(f"cannot read SLURM_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(found[1])] * int(found[2] or 1)
    return counts[node]


def rendezvous_port(job_id: int, restarts: int) -> int:
    """The job's rendezvous port, the same on every task without a word between them; a new
    one after each requeue (the last run's may still linger), below the ephemeral range."""
    return 10000 + (job_id * 97 + restarts * 7919) % 22000


if __name__ == "__main__":
    sys.exit(run_task(sys.argv[1]))
