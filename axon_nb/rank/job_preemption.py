"""(Rank) a batch job's preemption: on the notice signal every rank finishes the step in
flight (the loop's stop, agreed at a step boundary), writes a checkpoint into the job's
``checkpoints/`` and exits with :data:`PREEMPTED_EXIT`; a relaunched job resumes from the
newest complete one.

Example (``rank/job_rank.py``)::

    with Preemption(job_dir, "USR2") as notice:
        spec = resume_from_checkpoint(spec, job_dir, run_id)
        summary = train(spec, stop=notice.stop)
        if notice.arrived:
            notice.checkpoint(spec.name, summary["step"])
"""

from __future__ import annotations

import dataclasses
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

from axon_nb.rank.world.interrupts import StopSignal
from axon_nb.spec.checkpoint_format import SaveTarget
from axon_nb.spec.checkpoint_series import latest, path_for, remove_partial
from axon_nb.spec.job_files import PREEMPTED_EXIT, checkpoints_dir
from axon_nb.spec.kept_runs import write_atomically
from axon_nb.spec.train_spec import TrainSpec

__all__ = ["PREEMPTED_EXIT", "Preemption", "resume_from_checkpoint"]


class Preemption:
    """While active: the notice signal asks every rank to stop at the next step boundary
    (SIGINT still does, as on a cluster)."""

    def __init__(self, job_dir: str, signal_name: str) -> None:
        self.job_dir = job_dir
        self.signum = getattr(signal, f"SIG{signal_name.upper().removeprefix('SIG')}")
        self.stop = StopSignal()
        self.arrived: float | None = None
        """When the notice came (``time.time()``), or None."""
        self._saved: Any = None

    def __enter__(self) -> Preemption:
        self.stop.__enter__()
        self._saved = signal.signal(self.signum, self._notice)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(self.signum, self._saved)
        self.stop.__exit__(*exc)

    def _notice(self, signum: int, frame: FrameType | None) -> None:
        if self.arrived is None:
            self.arrived = time.time()
        self.stop.requested = True  # (the loop agrees on the step with every rank)

    def checkpoint(self, name: str, step: int) -> str:
        """Every rank: write run ``name`` at ``step`` into the job's checkpoints; its path."""
        import torch.distributed as dist

        from axon_nb.rank.checkpoint import checkpoint_io

        path = path_for(str(checkpoints_dir(self.job_dir)), step)
        target = SaveTarget(path=path, partial=f"{path}.partial-preempted", kind="sharded",
                            replaces=None)  # fmt: skip
        if dist.get_rank() == 0:
            Path(path).parent.mkdir(mode=0o700, exist_ok=True)
            target.create_partial()
        dist.barrier()
        checkpoint_io.save(name, target)
        if dist.get_rank() == 0:
            write_atomically(Path(self.job_dir) / "preempted.json",
                             f'{{"step": {step}, "notice_at": {self.arrived}, '
                             f'"saved_at": {time.time()}}}'.encode())  # fmt: skip
        dist.barrier()
        return path


def resume_from_checkpoint(spec: TrainSpec, job_dir: str, run_id: str, stop: StopSignal
                           ) -> TrainSpec:  # fmt: skip
    """``spec`` as it goes on from the job's newest complete checkpoint (the run built, the
    checkpoint loaded, the steps left), or ``spec`` itself when there is none."""
    import torch.distributed as dist

    from axon_nb.rank import runtime
    from axon_nb.rank.checkpoint import checkpoint_io
    from axon_nb.rank.training.loop import run

    directory = str(checkpoints_dir(job_dir))
    if dist.get_rank() == 0:
        remove_partial(directory)
    dist.barrier()
    found = latest(directory)
    if found is None:
        return spec
    build = dataclasses.replace(spec, steps=0, resume=False, checkpoint_dir=None,
                                checkpoint_every=None, checkpoint_every_s=None, keep=None,
                                max_restarts=0, metrics_interval_s=0)  # fmt: skip
    run(build, runtime.context(), sink=None, run_id=run_id, stop=stop)
    checkpoint_io.load(spec.name, found.path)
    return dataclasses.replace(spec, steps=spec.steps - found.step, resume=True)
