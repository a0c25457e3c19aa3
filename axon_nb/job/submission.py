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
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import cloudpickle

from axon_nb.errors import AxonError
from axon_nb.job.handle import Job
from axon_nb.job.job_index import index_job
from axon_nb.job.slurm import SIGNAL_DELAY_S, missing_slurm, submit_to_slurm
from axon_nb.spec.job_files import read_job, write_state
from axon_nb.spec.kept_runs import run_dir, write_atomically
from axon_nb.spec.make import make_spec
from axon_nb.spec.notice_signal import check_notice_signal
from axon_nb.spec.slurm_time import check_notice_time
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
    iface: str | None = None,
    signal_delay_s: int | None = None,
    **options: Any,
) -> Job:
    """Run ``cluster.train(model, data, **options)`` as a batch job of ``ranks`` ranks, with
    no kernel: the spec goes into ``job_dir`` (default ``./axon_jobs/<name>-<time>``) and
    ``python -m axon_nb.job JOB_DIR`` runs it under torchrun on this host
    (``launcher="torchrun"``), or Slurm runs it (``launcher="slurm"``, through submitit, with
    ``partition``, ``time_limit``, ``nodes``, ``gpus_per_node``, ``account``; ``iface``: the
    network the ranks talk over; ``signal_delay_s``: the notice comes that long before the
    time limit, 90 by default). Returns the :class:`~axon_nb.job.handle.Job`
    (``axon_nb.job(job_dir)`` finds it from any kernel). ``options`` are ``train``'s. Example::

        job = axon_nb.submit(model=make_model, data=ds, steps=500, batch_size=32, ranks=2)
        print(job.id, job.state)
        result = job.wait()
    """
    slurm = dict(partition=partition, time_limit=time_limit, nodes=nodes,
                 gpus_per_node=gpus_per_node, account=account, iface=iface,
                 signal_delay_s=signal_delay_s)  # fmt: skip
    _check_arguments(launcher, ranks, preempt_signal, slurm)
    spec = make_spec(DDP, model=model, data=data, **options)
    check_world(spec, ranks)
    payload = _pickled(spec)
    directory = _new_job_dir(job_dir, spec.name)
    run = uuid.uuid4().hex[:12]
    job = {
        "launcher": launcher, "ranks": ranks, "name": spec.name, "steps": spec.steps,
        "run": run, "requeue": requeue, "cwd": os.getcwd(), "python": sys.executable,
        "submitted_at": time.time(), "id": None, "preempt_signal": preempt_signal,
        "iface": iface,
    }  # fmt: skip
    (directory / "spec.pkl").write_bytes(payload)
    started = {"run": run, "steps": spec.steps, "targets": list(range(ranks)),
               "strategy": spec.strategy.describe(), "kernel_pid": 0,
               "started_at": time.time(), "streams": spec.streams}  # fmt: skip
    run_dir(directory, spec.name).mkdir(parents=True, mode=0o700)
    write_atomically(run_dir(directory, spec.name) / "run.json", json.dumps(started).encode())
    write_atomically(directory / "job.json", json.dumps(job, indent=1).encode())
    write_state(directory, "submitted")
    if launcher == "slurm":
        _write_sbatch_run_sh(directory)
        try:
            job_id = submit_to_slurm(
                directory, name=spec.name, ranks=ranks, nodes=nodes or 1, requeue=requeue,
                preempt_signal=preempt_signal, partition=partition, time_limit=time_limit,
                gpus_per_node=gpus_per_node, account=account,
                signal_delay_s=SIGNAL_DELAY_S if signal_delay_s is None else signal_delay_s,
            )  # fmt: skip
        except BaseException:
            (directory / "job.json").unlink(missing_ok=True)  # (no job: the dir may be reused)
            raise
        supervisor_pid = None
    else:
        command = [sys.executable, "-m", "axon_nb.job", str(directory)]
        _write_run_sh(directory, command, "run it again")
        supervisor = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, cwd=os.getcwd(),
        )  # fmt: skip
        job_id, supervisor_pid = f"local-{supervisor.pid}", supervisor.pid
    job["id"] = job_id  # (the supervisor or the tasks have read what they need)
    write_atomically(directory / "job.json", json.dumps(job, indent=1).encode())
    index_job(job_id, directory)
    return Job(directory, supervisor_pid=supervisor_pid)


def _check_arguments(launcher: str, ranks: int, preempt_signal: str, slurm: dict[str, Any]) -> None:
    """Refuse what cannot be submitted, before anything is written."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if launcher == "slurm" and (why := missing_slurm()) is not None:
        raise AxonError(why)
    given = [k for k, v in slurm.items() if v is not None]
    if launcher != "slurm" and given:
        raise ValueError(f"{', '.join(given)} are Slurm options: use launcher='slurm'")
    check_notice_signal(preempt_signal, cluster=False)
    if slurm["time_limit"] is not None:
        delay = slurm["signal_delay_s"]
        check_notice_time(str(slurm["time_limit"]), SIGNAL_DELAY_S if delay is None else delay)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
    nodes = slurm["nodes"]
    bad_nodes = isinstance(nodes, bool) or not isinstance(nodes, int | None) or (nodes or 1) < 1
    if launcher == "slurm" and (bad_nodes or ranks % (nodes or 1)):
        raise ValueError(
            f"nodes={nodes!r} must be a positive integer that divides ranks={ranks} (each "
            "node runs ranks // nodes ranks)"
        )


def _write_run_sh(directory: Path, command: list[str], again: str) -> None:
    (directory / "run.sh").write_text(
        f"#!/bin/sh\n# This job's command; {again} with: sh run.sh\n"
        f"cd {shlex.quote(os.getcwd())}\nexec {shlex.join(command)}\n"
    )


def _write_sbatch_run_sh(directory: Path) -> None:
    """``sbatch job.sbatch`` (options given to ``sh run.sh`` go to sbatch), then the new id
    noted in the job's directory, so ``axon_nb.job(job_dir)`` follows the new submission."""
    sbatch = shlex.quote(str(directory / "job.sbatch"))
    note = shlex.join([sys.executable, "-m", "axon_nb.job", "--submitted", str(directory)])
    (directory / "run.sh").write_text(
        "#!/bin/sh\n# This job's submission; submit it again with: sh run.sh [sbatch options]\n"
        f"cd {shlex.quote(os.getcwd())}\n"
        f'id=$(sbatch --parsable "$@" {sbatch}) || exit 1\n'
        f'exec {note} "${{id%%;*}}"\n'
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
