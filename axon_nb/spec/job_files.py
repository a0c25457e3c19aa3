"""A batch job's directory (``axon_nb.submit``): what the kernel writes, what the job's
supervisor and ranks write, and what any kernel reads to follow it (``axon_nb.job``).

Layout (the directory is owner-only, 0700)::

    job.json        what was submitted: launcher, ranks, run id, the command
    spec.pkl        the training spec (cloudpickle: notebook functions travel by value)
    run.sh          the command, to read and to run again by hand: ``sh run.sh``
    state.json      the job's state (submitted, running, finished, failed, cancelled) and
                    its supervisor's pid
    supervisor.log  what the launcher (torchrun) printed
    runs/<name>/    the run's metrics stream and summaries per rank (``spec/kept_runs.py``)
    output/         each rank's stdout and stderr
    job.sbatch      (Slurm) the batch script submitit wrote: ``sbatch job.sbatch`` again
    slurm/          (Slurm) submitit's folder: the task it runs, Slurm's output per task

Pure Python: the kernel, the supervisor and the ranks import it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from axon_nb.spec.kept_runs import write_atomically

STATES = ("submitted", "running", "preempted", "requeued", "finished", "failed", "cancelled")
FINAL_STATES = ("finished", "failed", "cancelled", "preempted")
"""A job ends in one of these (``preempted``: without ``requeue``, it waits to be run again:
``sh run.sh`` resumes it from its checkpoint)."""
PREEMPTED_EXIT = 99
"""A rank's exit code after it checkpointed on a preemption notice."""


def checkpoints_dir(job_dir: str | os.PathLike[str]) -> Path:
    """Where a job's preemption checkpoints go (``step-<n>`` each)."""
    return Path(job_dir) / "checkpoints"


def requeue_marker(job_dir: str | os.PathLike[str]) -> Path:
    """A Slurm job's rank 0 makes it after a notice; the batch script then requeues the job
    (from inside a task, ``scontrol requeue`` ends the tasks before they exit by themselves:
    Slurm then waits its KillWait before the job may start again)."""
    return Path(job_dir) / "slurm" / "requeue"


def read_json(path: Path) -> dict[str, Any]:
    try:
        value: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value


def read_job(job_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What was submitted (``job.json``); empty when this is no job's directory."""
    return read_json(Path(job_dir) / "job.json")


def read_state(job_dir: str | os.PathLike[str]) -> dict[str, Any]:
    return read_json(Path(job_dir) / "state.json")


def mark_state(job_dir: str | os.PathLike[str], **fields: Any) -> None:
    """Set fields of the job's state, keeping its state as it is now."""
    path = Path(job_dir) / "state.json"
    merged = {**read_json(path), **fields, "updated": time.time()}
    write_atomically(path, json.dumps(merged).encode())


def write_state(job_dir: str | os.PathLike[str], state: str, **fields: Any) -> None:
    """Set the job's state (and other fields), keeping the fields not given."""
    assert state in STATES, state
    path = Path(job_dir) / "state.json"
    merged = {**read_json(path), **fields, "state": state, "updated": time.time()}
    write_atomically(path, json.dumps(merged).encode())
