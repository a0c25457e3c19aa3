"""``Job``: a batch job (``axon_nb.submit``) seen from any kernel, read from its directory.

Example::

    job = axon_nb.job("axon_jobs/model-20261129-061200-ab12")
    job.state, job.history[-1]["loss"]
    job.dashboard          # live, with every step since the job began
    result = job.wait()
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axon_nb.cluster.detached import process_start, same_process
from axon_nb.errors import AxonError, RankError
from axon_nb.job.slurm import scancel
from axon_nb.job.slurm_state import cancel_slurm_job, slurm_job_state
from axon_nb.job.supervisor import rank_pids
from axon_nb.spec.job_files import FINAL_STATES, read_job, read_state
from axon_nb.spec.kept_runs import last_step, stream_path
from axon_nb.train.kept_handle import KeptHandle, read_started

if TYPE_CHECKING:
    from axon_nb.train.result import TrainResult
    from axon_nb.widgets.dashboard import Dashboard

CANCEL_S = 15.0
"""How long ``cancel`` waits for the job's processes to end."""


class Job:
    """A submitted job: its id, directory, state, history, dashboard and result."""

    def __init__(self, job_dir: str | os.PathLike[str], *, supervisor_pid: int | None = None):
        self.dir = Path(job_dir).resolve()
        _check_owned(self.dir)
        self._job = read_job(self.dir)
        if not self._job:
            raise AxonError(
                f"{self.dir} is not a job's directory (no job.json): give the job_dir "
                "axon_nb.submit wrote, or see axon_nb.jobs()"
            )
        self._supervisor = supervisor_pid
        self._started = process_start(supervisor_pid) if supervisor_pid else None
        self._handle: KeptHandle | None = None

    @property
    def id(self) -> str:
        """``local-<pid>`` for a job on this host (its supervisor's pid); a Slurm job's id
        (the latest, after a resubmission by hand)."""
        resubmitted = read_state(self.dir).get("slurm_job_id")
        return str(resubmitted or read_job(self.dir).get("id") or self._job.get("id"))

    @property
    def on_slurm(self) -> bool:
        return self._job.get("launcher") == "slurm"

    @property
    def name(self) -> str:
        return str(self._job["name"])

    @property
    def state(self) -> str:
        """``submitted``, ``running``, ``requeued`` (preempted, being relaunched),
        ``preempted`` (checkpointed, not requeued), ``finished``, ``failed`` or
        ``cancelled``."""
        if self.on_slurm:
            return slurm_job_state(self.dir, self.id, requeue=bool(self._job.get("requeue")))
        state = read_state(self.dir)
        if state.get("state") in ("submitted", "running", "requeued") and not (
            self._supervisor_alive(state)
        ):
            return "failed"  # (its supervisor is gone without a word)
        return str(state.get("state", "submitted"))

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every step since the job began, as ``TrainResult.history``."""
        return self.handle().history

    @property
    def dashboard(self) -> Dashboard:
        """The job's live dashboard (display it, or ``job.show()``)."""
        return self.handle().dashboard

    def show(self) -> None:
        self.handle().show()

    def pids(self) -> list[int]:
        """The ranks' processes, while they run (a torchrun job, on this host; a Slurm job's
        run on its nodes: ``[]``)."""
        if self.on_slurm:
            return []
        torchrun = read_state(self.dir).get("torchrun_pid")
        return rank_pids(int(torchrun)) if torchrun else []

    def wait(self, timeout: float | None = None) -> TrainResult:
        """Block until the job ends; the ``TrainResult`` its training returned (with a
        requeued job, the whole run's)."""
        try:
            result = self.handle().wait(timeout)
        except RankError:
            state = read_state(self.dir)
            if state.get("state") == "preempted":
                raise AxonError(
                    f"job {self.id} was preempted and checkpointed (it was submitted without "
                    f"requeue): `sh {self.dir / 'run.sh'}` resumes it from its checkpoint"
                ) from None
            raise
        self._wait_for_end(timeout)
        return result

    def stop(self, timeout: float | None = None) -> TrainResult:
        """Stop every rank at the same step boundary (a run that has not begun stops after
        its first step), wait for the job to end, and return the result so far; the job is
        then ``finished``. ``cancel()`` ends it where it is instead. Example::

            result = job.stop()
            result.step  # the step every rank stopped after
        """
        result = self.handle().stop(timeout)
        self._wait_for_end(timeout)
        return result

    def _wait_for_end(self, timeout: float | None) -> None:
        """The ranks kept their summaries; the job's end (torchrun's, or Slurm's and its
        batch script's) follows. Waited for as long as ``timeout`` allows, CANCEL_S at least."""
        grace = None if timeout is None else max(CANCEL_S, timeout)
        deadline = None if grace is None else time.monotonic() + grace
        while self.state not in FINAL_STATES:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {self.id}'s ranks are done but the job is still {self.state!r} "
                    f"{grace:g} s later; call wait() again"
                )
            time.sleep(0.05)

    def cancel(self) -> None:
        """End the job; its state becomes ``cancelled``. A torchrun job's ranks stop where
        they are; a Slurm job's take ``scancel``'s SIGTERM as a notice and checkpoint first
        (within Slurm's KillWait)."""
        if self.on_slurm:
            return cancel_slurm_job(self.dir, self.id)
        state = read_state(self.dir)
        pid = state.get("supervisor_pid") or self._supervisor
        if pid and self._supervisor_alive(state):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(pid), signal.SIGTERM)
        deadline = time.monotonic() + CANCEL_S
        while read_state(self.dir).get("state") not in FINAL_STATES:
            if time.monotonic() > deadline:
                raise AxonError(f"job {self.id} did not end within {CANCEL_S:g} s of cancel()")
            time.sleep(0.1)

    def handle(self) -> KeptHandle:
        """The job's run, as an attached kernel sees a detached cluster's."""
        if self._handle is None:
            targets = list(range(int(self._job["ranks"])))

            def alive() -> dict[int, bool]:
                running = self.state in ("submitted", "running", "requeued")
                return dict.fromkeys(targets, running)

            self._handle = KeptHandle(
                self.dir, self.name, read_started(self.dir, self.name), alive=alive,
                interrupt=lambda ranks: self._signal(signal.SIGINT), where=f"job {self.id}",
            )  # fmt: skip
        return self._handle

    def _signal(self, signum: int) -> None:
        if self.on_slurm:
            return scancel(self.id, signal.Signals(signum).name.removeprefix("SIG"))
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    def _supervisor_alive(self, state: dict[str, Any]) -> bool:
        pid = state.get("supervisor_pid") or self._supervisor
        if not pid:
            return time.time() - float(self._job.get("submitted_at", 0)) < 30
        return same_process(int(pid), self._started if pid == self._supervisor else None)

    def __repr__(self) -> str:
        step = last_step(stream_path(self.dir, self.name, 0))
        return f"<Job {self.id} {self.state}, step {step} of {self._job['steps']}, {self.dir}>"


def _check_owned(directory: Path) -> None:
    """Refuse a job directory that is not this user's alone: its summaries are unpickled."""
    try:
        info = directory.stat()
    except OSError:
        return  # (no such directory: the caller says it is not a job's)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise AxonError(
            f"{directory} is not yours alone (owner uid {info.st_uid}, mode "
            f"{oct(info.st_mode & 0o777)}): a job's directory is read and its results "
            "unpickled only when only you can write it (axon_nb.submit makes it 0700)"
        )
