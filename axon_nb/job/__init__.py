"""Batch jobs: ``axon_nb.submit`` runs a training as a job that needs no kernel;
``axon_nb.job(job_dir)`` follows one from any kernel and ``axon_nb.jobs()`` lists yours;
``python -m axon_nb.job JOB_DIR`` runs one (``supervisor.py``).

This package is also callable (``axon_nb.job(...)``, as the issue asks): Python makes
``axon_nb.job`` the package once it is imported, so the package is the function.

Example::

    job = axon_nb.submit(model=make_model, data=ds, steps=500, batch_size=32, ranks=2)
    axon_nb.job(job.dir).wait()
    axon_nb.jobs()   # [<Job local-4242 finished, step 500 of 500, ...>]
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (loaded on first use: ``python -m axon_nb.job`` needs none of it)
    from axon_nb.job.handle import Job


def job(job_dir: str | os.PathLike[str]) -> Job:
    """The job whose directory is ``job_dir``, or whose id ``axon_nb.jobs()`` shows (a Slurm
    job id works from any host that can ask Slurm: its output says where its directory is).

    Example::

        job = axon_nb.job("axon_jobs/model-20261129-061200-ab12")
        job = axon_nb.job("4242")     # a Slurm job's id
    """
    from axon_nb.cluster.detached import private_runtime_dir
    from axon_nb.job.handle import Job

    indexed = private_runtime_dir("axon-jobs") / f"{os.fspath(job_dir)}.json"
    if not os.path.isdir(job_dir) and indexed.is_file():
        job_dir = json.loads(indexed.read_text())["dir"]
    elif not os.path.isdir(job_dir) and os.fspath(job_dir).isdigit():
        from axon_nb.job.slurm import slurm_job_dir

        job_dir = slurm_job_dir(os.fspath(job_dir)) or job_dir
    return Job(job_dir)


def jobs() -> list[Job]:
    """This user's jobs submitted from this host, oldest first (those whose directory is
    gone are dropped). Example::

        for j in axon_nb.jobs():
            print(j.id, j.state)
    """
    from axon_nb.cluster.detached import private_runtime_dir
    from axon_nb.job.handle import Job

    found = []
    for entry in private_runtime_dir("axon-jobs").glob("*.json"):
        try:
            found.append(Job(json.loads(entry.read_text())["dir"]))
        except Exception:  # (its directory is gone, or not a job's any more)
            entry.unlink(missing_ok=True)
    return sorted(found, key=lambda j: float(j._job.get("submitted_at", 0)))


class _CallableModule(types.ModuleType):
    def __call__(self, job_dir: str | os.PathLike[str]) -> Job:
        return job(job_dir)

    def __repr__(self) -> str:
        return "<function axon_nb.job (and its package)>"


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["Job", "job", "jobs"]


def __getattr__(name: str) -> Any:
    if name == "Job":
        from axon_nb.job.handle import Job

        return Job
    raise AttributeError(f"module 'axon_nb.job' has no attribute {name!r}")
