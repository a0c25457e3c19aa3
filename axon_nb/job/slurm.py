"""A batch job on Slurm, from the kernel: submitted through submitit (it writes the sbatch
file and runs the pickled task in every task of the job), followed without accounting
(``squeue`` while the job is queued or runs, ``scontrol show job`` for ``MinJobAge`` after),
signalled and cancelled with ``scancel``.

Example (what ``axon_nb.submit(launcher="slurm", ...)`` does)::

    job_id = submit_to_slurm(job_dir, ranks=4, nodes=2, partition="gpu", time_limit="2:00:00",
                             requeue=True, preempt_signal="USR2")
    slurm_state(job_id)     # "PENDING", "RUNNING", ..., or None once Slurm forgot it
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from axon_nb.errors import AxonError
from axon_nb.rank import entry
from axon_nb.spec.job_files import requeue_marker

TOOLS = ("sbatch", "srun", "squeue", "scontrol", "scancel")

SIGNAL_DELAY_S = 90
"""How long before the time limit Slurm sends the notice (``--signal=USR2@90``)."""


def missing_slurm() -> str | None:
    """Why a Slurm job cannot be submitted from here (said before anything is written)."""
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return (
            f"launcher='slurm' needs Slurm's {', '.join(absent)}, and this host's PATH has "
            "none: submit from a Slurm login node, or use launcher='torchrun' to run on this host"
        )
    try:
        import submitit  # noqa: F401
    except ImportError:
        return (
            "launcher='slurm' submits through submitit, which is not installed: "
            "pip install 'axon_nb[jobs]'"
        )
    return None


def submit_to_slurm(
    job_dir: Path,
    *,
    name: str,
    ranks: int,
    nodes: int,
    requeue: bool,
    preempt_signal: str,
    partition: str | None = None,
    time_limit: str | None = None,
    gpus_per_node: int | None = None,
    account: str | None = None,
    cpus_per_task: int | None = None,
    signal_delay_s: int = SIGNAL_DELAY_S,
) -> str:
    """Submit the job in ``job_dir`` (its spec written) as ``ranks`` tasks on ``nodes`` nodes;
    its Slurm job id. The sbatch file is kept as ``job_dir/job.sbatch`` (``sbatch`` it again
    by hand to resume a preempted job)."""
    import submitit
    from submitit.core.utils import DelayedSubmission

    folder = job_dir / "slurm"
    folder.mkdir(mode=0o700, exist_ok=True)
    task = folder / "task.pkl"  # (what every submission of this job runs: its own id's copy)
    DelayedSubmission(entry.slurm_task, str(job_dir)).dump(task)
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=0)
    extra: dict[str, Any] = {
        "signal": f"{preempt_signal.upper().removeprefix('SIG')}@{signal_delay_s}",
        "requeue" if requeue else "no-requeue": True,
    }
    if time_limit is not None:
        extra["time"] = time_limit  # (Slurm's own forms: "90", "1:30:00", "2-00:00:00")
    parameters: dict[str, Any] = dict(
        job_name=name, nodes=nodes, ntasks_per_node=ranks // nodes, partition=partition,
        gpus_per_node=gpus_per_node, account=account, cpus_per_task=cpus_per_task,
        # a resubmission by hand (`sbatch job.sbatch`) gets a new id: give it the task
        # (and a requeue marker a past run left, its batch script ended before its teardown)
        setup=[f"f={shlex.quote(str(folder))}/${{SLURM_JOB_ID}}_submitted.pkl; "
               f'[ -e "$f" ] || cp {shlex.quote(str(task))} "$f"',
               f"rm -f {shlex.quote(str(requeue_marker(job_dir)))}"],
        # once every task has ended: requeue when rank 0 asked for it (a notice)
        teardown=[f"if [ -e {shlex.quote(str(requeue_marker(job_dir)))} ]; then "
                  f"rm -f {shlex.quote(str(requeue_marker(job_dir)))}; "
                  'scontrol requeue "$SLURM_JOB_ID"; fi'],
        additional_parameters=extra,
    )  # fmt: skip
    # (time=None: the partition's default limit, not submitit's 5 minutes)
    given = {k: v for k, v in parameters.items() if v is not None}
    executor.update_parameters(**given, **({} if time_limit else {"time": None}))
    try:
        submitted = executor.submit(entry.slurm_task, str(job_dir))
    except Exception as e:  # (sbatch refused it: a partition, a limit, an account)
        raise AxonError(f"Slurm refused the job: {e}") from e
    sbatch = folder / f"{submitted.job_id}_submission.sh"
    if sbatch.exists():
        shutil.copyfile(sbatch, job_dir / "job.sbatch")
    return str(submitted.job_id)


UNREACHABLE = "UNREACHABLE"
"""What :func:`slurm_state` says when Slurm could not be asked (a timeout, a busy slurmctld):
the job's own state stands, it is no sign of an end."""

ASK_EVERY_S = 2.0
"""Slurm is asked about a job at most this often (a dashboard and ``wait`` look many times a
second; a shared slurmctld must not get a command for each look)."""

_asked: dict[str, tuple[float, str | None]] = {}


def slurm_state(job_id: str, *, newer_than: float = 0.0) -> str | None:
    """Slurm's state of ``job_id`` (``PENDING``, ``RUNNING``, ``COMPLETED``, ``CANCELLED``,
    ...), None when Slurm no longer knows it, or :data:`UNREACHABLE`. An answer is reused for
    ``ASK_EVERY_S``, unless it is older than ``newer_than`` (``time.time()``: the job's own
    word since)."""
    when, said = _asked.get(job_id, (0.0, UNREACHABLE))
    now = time.time()
    if when >= newer_than and now - when < ASK_EVERY_S:
        return said
    said = _ask(job_id)
    _asked[job_id] = (now, said)
    return said


def _ask(job_id: str) -> str | None:
    try:
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"],
                                capture_output=True, text=True, timeout=30)  # fmt: skip
        if queued.returncode == 0 and queued.stdout.strip():
            return queued.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        return UNREACHABLE
    shown = _shown(job_id)
    if shown is None:
        return UNREACHABLE
    return shown.get("JobState") or (None if "_invalid" in shown else UNREACHABLE)


def _shown(job_id: str) -> dict[str, str] | None:
    """``scontrol show job``'s fields (``{"_invalid": ""}`` when Slurm does not know the job),
    or None when Slurm could not be asked."""
    try:
        shown = subprocess.run(["scontrol", "-o", "show", "job", job_id],
                               capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if "Invalid job id" in shown.stderr:
        return {"_invalid": ""}
    return dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)


def slurm_job_dir(job_id: str) -> str | None:
    """The job directory of the axon_nb job ``job_id`` (from where Slurm writes its output),
    or None when Slurm does not know it or it is no axon_nb job."""
    out = Path((_shown(job_id) or {}).get("StdOut", "/"))  # JOB_DIR/slurm/<id>_0_log.out
    return str(out.parent.parent) if (out.parent.parent / "job.json").exists() else None


def scancel(job_id: str, signal_name: str | None = None) -> None:
    """Cancel ``job_id``, or send its tasks ``signal_name`` (``INT``: stop at a step)."""
    command = ["scancel", *([f"--signal={signal_name}"] if signal_name else []), job_id]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise AxonError(f"scancel {job_id} failed: {done.stderr.strip()}")
