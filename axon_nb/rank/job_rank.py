"""(Rank) one rank of a batch job (``axon_nb.submit``), started by torchrun: join the world
torchrun describes, train the job's spec with the loop every cluster runs, keep the metrics
stream, output and summary in the job's directory (``spec/job_files.py``).

On the job's notice signal (``USR2`` by default) every rank checkpoints at the same step and
exits with ``PREEMPTED_EXIT``; a relaunch goes on from there (``rank/preemption.py``).

Usage (what the job's supervisor runs through torchrun):
``python -m torch.distributed.run --standalone --nproc-per-node N -m axon_nb.rank.job_rank
JOB_DIR``.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

from axon_nb.rank import runtime
from axon_nb.rank.preemption import (
    PREEMPTED_EXIT,
    Preemption,
    hold_notices,
    resume_from_checkpoint,
)
from axon_nb.rank.world import kept_runs
from axon_nb.spec.job_files import checkpoints_dir, read_job
from axon_nb.spec.kept_runs import write_atomically
from axon_nb.spec.train_spec import TrainSpec


def main(job_dir: str, *, batch: bool = False) -> int:
    """Run this rank of the job in ``job_dir``; 0, or ``PREEMPTED_EXIT`` after a notice.
    ``batch``: a Slurm batch job, where SIGTERM (preemption) is a notice too."""
    job = read_job(job_dir)
    hold_notices(str(job.get("preempt_signal", "USR2")))  # (one during the setup is kept)
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    device = torch.device(f"cuda:{local}") if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    backend = "nccl" if gpu else "gloo"
    timeout = float(job.get("timeout_s", 300))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    runtime.set_context(runtime.RankContext(
        rank=rank, world_size=world, local_rank=local, local_world_size=local_world,
        host=socket.gethostname(), pid=os.getpid(), device=device, backend=backend,
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(os.environ.get("MASTER_PORT", "0")), timeout_s=timeout,
    ))  # fmt: skip
    kept_runs.keep(job_dir, rank)
    with open(Path(job_dir) / "spec.pkl", "rb") as f:
        spec: TrainSpec = pickle.load(f)  # (the job's own owner-only directory)
    with Preemption(str(job.get("preempt_signal", "USR2")), sigterm=batch) as notice:
        try:
            summary = _train(spec, job_dir, job["run"], notice)
        except BaseException as e:
            error = (type(e).__name__, str(e), traceback.format_exc())
            kept_runs.keep_end(spec.name, {"error": error})
            raise
        if summary.get("status") == "stopped" and notice.agree():
            said = notice.checkpoint(spec.name, int(summary["step"]), checkpoints_dir(job_dir))
            if rank == 0:
                write_atomically(Path(job_dir) / "preempted.json", json.dumps(said).encode())
            dist.barrier()
            dist.destroy_process_group()
            return PREEMPTED_EXIT
    kept_runs.keep_end(spec.name, summary)
    dist.destroy_process_group()
    return 0


def _train(spec: TrainSpec, job_dir: str, run_id: str, notice: Preemption) -> dict[str, Any]:
    """Train ``spec`` (on from the job's checkpoint if it was preempted before)."""
    from axon_nb.rank.training.loop import run

    resumed = resume_from_checkpoint(spec, job_dir, run_id, notice.stop)
    sink = kept_runs.kept_sink(lambda message: None, spec.name, run_id, fresh=resumed is spec)
    summary, _ = run(resumed, runtime.context(), sink=sink, run_id=run_id, stop=notice.stop)
    return summary


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
