"""A Slurm job's state as ``Job.state`` says it: what its tasks wrote into its directory,
checked against Slurm's word (``job/slurm.py::slurm_state``) while that is not final.

Example::

    slurm_job_state(job_dir, "4242")   # "running"
"""

from __future__ import annotations

import time
from pathlib import Path

from axon_nb.errors import AxonError
from axon_nb.job.slurm import UNREACHABLE, scancel, slurm_state
from axon_nb.spec.job_files import FINAL_STATES, mark_state, read_state, write_state

QUEUED = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED",
          "RESV_DEL_HOLD")  # fmt: skip
RUNNING = ("RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING")
ENDED = {"CANCELLED": "cancelled", "PREEMPTED": "preempted"}
"""Slurm's end states that say more than "failed" (FAILED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY,
BOOT_FAIL, DEADLINE, and COMPLETED without the tasks' word, are all "failed")."""

CANCEL_S = 60.0
"""How long ``cancel`` waits for Slurm to end the job (its tasks checkpoint first)."""


def slurm_job_state(job_dir: Path, job_id: str, *, requeue: bool) -> str:
    """``submitted``, ``running``, ``requeued``, or a final state (``FINAL_STATES``).
    ``requeue``: the job was submitted with it (Slurm's ``PREEMPTED`` then passes on to
    pending, and so does the job)."""
    state = read_state(job_dir)
    own = str(state.get("state", "submitted"))
    if own in FINAL_STATES:
        return own
    slurm = slurm_state(job_id, newer_than=float(state.get("updated", 0)))
    if slurm == UNREACHABLE:
        return own
    if slurm is None:  # (Slurm forgot it, MinJobAge after its end, with no word from it)
        fresh = time.time() - float(state.get("updated", 0)) < 60
        return own if fresh else "failed"
    if slurm in QUEUED:
        return "requeued" if own in ("requeued", "running") else "submitted"
    if slurm in RUNNING:
        return "running"
    if slurm == "PREEMPTED" and requeue:
        return "requeued"
    final = str(read_state(job_dir).get("state"))  # (the tasks' word may have come since)
    return final if final in FINAL_STATES else ENDED.get(slurm, "failed")


def cancel_slurm_job(job_dir: Path, job_id: str) -> None:
    """``scancel`` the job and wait until Slurm ended it; its state becomes ``cancelled``.
    Its ranks take the SIGTERM as a notice and checkpoint first (within Slurm's KillWait)."""
    if str(read_state(job_dir).get("state")) in FINAL_STATES:
        return
    mark_state(job_dir, cancel_requested=True)  # (rank 0 then writes "cancelled")
    try:
        scancel(job_id)
    except BaseException:
        mark_state(job_dir, cancel_requested=False)  # (a later notice is no cancel)
        raise
    deadline = time.monotonic() + CANCEL_S
    while slurm_state(job_id) in (*QUEUED, *RUNNING, UNREACHABLE):
        if time.monotonic() > deadline:
            raise AxonError(f"Slurm did not end job {job_id} within {CANCEL_S:g} s of cancel()")
        time.sleep(0.2)
    if str(read_state(job_dir).get("state")) not in FINAL_STATES:
        write_state(job_dir, "cancelled")
