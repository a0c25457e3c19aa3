"""``axon_nb.submit``: the same training as ``cluster.train``, as a batch job that needs no
kernel (``spec/job_files.py`` says what its directory holds).

Example::

    job = axon_nb.submit(model=make_model, data=ds, strategy=FSDP(), steps=1000,
                         batch_size=64, ranks=2, launcher="torchrun")
    job.wait()   # the TrainResult cluster.train would return
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import cloudpickle

from axon_nb.cluster.detached import private_runtime_dir
from axon_nb.errors import AxonError
from axon_nb.job.handle import Job
from axon_nb.spec.job_files import read_job, write_state
from axon_nb.spec.kept_runs import run_dir, write_atomically
from axon_nb.spec.make import make_spec
from axon_nb.spec.validation import check_world
from axon_nb.strategies import DDP

LAUNCHERS = ("torchrun", "slurm")


def submit(
    model: Any = None,
    data: Any = None,
    *,
    ranks: int,
    launcher: str = "torchrun",
    job_dir: str | os.PathLike[str] | None = None,
    requeue: bool = False,
    preempt_signal: str = "USR2",
    partition: str | None = None,
    time_limit: str | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    account: str | None = None,
    **options: Any,
) -> Job:
    """Run ``cluster.train(model, data, **options)`` as a batch job of ``ranks`` ranks, with
    no kernel: the spec goes into ``job_dir`` (default ``./axon_jobs/<name>-<time>``) and
    ``python -m axon_nb.job JOB_DIR`` runs it (``launcher="torchrun"``: under torchrun on
    this host). Returns the :class:`~axon_nb.job.handle.Job` (``axon_nb.job(job_dir)`` finds
    it from any kernel). ``options`` are ``train``'s. Example::

        job = axon_nb.submit(model=make_model, data=ds, steps=500, batch_size=32, ranks=2)
        print(job.id, job.state)
        result = job.wait()
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    slurm = dict(partition=partition, time_limit=time_limit, nodes=nodes,
                 gpus_per_node=gpus_per_node, account=account)  # fmt: skip
    if launcher == "slurm":
        _refuse_slurm()
    given = [k for k, v in slurm.items() if v is not None]
    if given:
        raise ValueError(f"{', '.join(given)} are Slurm options: use launcher='slurm'")
    _check_signal(preempt_signal)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
    spec = make_spec(DDP, model=model, data=data, **options)
    check_world(spec, ranks)
    payload = _pickled(spec)
    directory = _new_job_dir(job_dir, spec.name)
    run = uuid.uuid4().hex[:12]
    job = {
        "launcher": launcher, "ranks": ranks, "name": spec.name, "steps": spec.steps,
        "run": run, "requeue": requeue, "cwd": os.getcwd(), "python": sys.executable,
        "submitted_at": time.time(), "id": None, "preempt_signal": preempt_signal,
    }  # fmt: skip
    (directory / "spec.pkl").write_bytes(payload)
    command = [sys.executable, "-m", "axon_nb.job", str(directory)]
    (directory / "run.sh").write_text(
        "#!/bin/sh\n# This job's command; run it again with: sh run.sh\n"
        f"cd {shlex.quote(os.getcwd())}\nexec {shlex.join(command)}\n"
    )
    started = {"run": run, "steps": spec.steps, "targets": list(range(ranks)),
               "strategy": spec.strategy.describe(), "kernel_pid": 0,
               "started_at": time.time()}  # fmt: skip
    run_dir(directory, spec.name).mkdir(parents=True, mode=0o700)
    write_atomically(run_dir(directory, spec.name) / "run.json", json.dumps(started).encode())
    write_atomically(directory / "job.json", json.dumps(job, indent=1).encode())
    write_state(directory, "submitted")
    supervisor = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True, cwd=os.getcwd(),
    )  # fmt: skip
    job_id = f"local-{supervisor.pid}"
    job["id"] = job_id  # (the supervisor has read what it needs)
    write_atomically(directory / "job.json", json.dumps(job, indent=1).encode())
    _index(job_id, directory)
    return Job(directory, supervisor_pid=supervisor.pid)


def _check_signal(name: str) -> None:
    """The notice may be any catchable signal but SIGUSR1 (axon_nb's stack dumps, and
    NCCL's), SIGINT (a stop) and SIGTERM (a cancel, on this host)."""
    import signal

    wanted = f"SIG{str(name).upper().removeprefix('SIG')}"
    taken = {"SIGUSR1": "axon_nb's stack-dump signal (and NCCL's)", "SIGINT": "a stop",
             "SIGTERM": "cancel() on this host", "SIGKILL": "uncatchable",
             "SIGSTOP": "uncatchable"}  # fmt: skip
    if not hasattr(signal, wanted) or wanted in taken:
        why = f" ({taken[wanted]})" if wanted in taken else ""
        raise ValueError(
            f"preempt_signal={name!r} cannot be the notice{why}: use USR2 (the default), or "
            "another catchable signal such as URG"
        )


def _refuse_slurm() -> None:
    if shutil.which("sbatch") is None:
        raise AxonError(
            "launcher='slurm' submits with sbatch, and there is no sbatch on this host's PATH: "
            "submit from a Slurm login node, or use launcher='torchrun' to run on this host"
        )
    raise AxonError(
        "launcher='slurm' is not built yet (submission through submitit is planned): use "
        "launcher='torchrun', or start an interactive cluster in the allocation with "
        "`%axon_cluster N --engines slurm`"
    )


def _pickled(spec: Any) -> bytes:
    """The spec, pickled by value; what cannot be pickled is named, with what to do."""
    try:
        return bytes(cloudpickle.dumps(spec))
    except Exception as e:
        raise ValueError(
            f"the job's arguments cannot be pickled ({type(e).__name__}: {e}): a batch job "
            "gets them through a file, so the model factory, data, loss and metrics must be "
            "picklable; build unpicklable things (open files, locks, live connections, "
            "generators) inside the model or data factory instead of passing them"
        ) from e


def _new_job_dir(job_dir: str | os.PathLike[str] | None, name: str) -> Path:
    """``job_dir`` made (0700), or a new one under ``./axon_jobs``; one holding a job is
    refused."""
    if job_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        job_dir = Path("axon_jobs") / f"{name}-{stamp}-{uuid.uuid4().hex[:4]}"
    directory = Path(job_dir).resolve()
    if read_job(directory):
        raise AxonError(
            f"{directory} holds another job ({read_job(directory).get('id')}): give a new "
            "job_dir, or follow that one with axon_nb.job(job_dir)"
        )
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    directory.chmod(0o700)
    return directory


def _index(job_id: str, directory: Path) -> None:
    """Note the job in this user's list (``axon_nb.jobs()``)."""
    index = private_runtime_dir("axon-jobs")
    write_atomically(index / f"{job_id}.json", json.dumps({"dir": str(directory)}).encode())
