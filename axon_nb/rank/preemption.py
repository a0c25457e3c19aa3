"""(Rank) preemption: on the notice signal every rank finishes the step in flight (the loop's
stop, agreed at a step boundary) and writes its part of a sharded checkpoint. A batch job then
exits with :data:`PREEMPTED_EXIT` and its relaunch resumes from the newest complete one
(``resume_from_checkpoint``); on a cluster (``Cluster(preempt_signal=...)``, inside a Slurm
allocation or detached) ``train`` returns, stopped, saying where the checkpoint is.

Example (``rank/job_rank.py``)::

    with Preemption("USR2") as notice:
        spec = resume_from_checkpoint(spec, job_dir, run_id, notice.stop)
        summary = train(spec, stop=notice.stop)
        if notice.arrived:
            notice.checkpoint(spec.name, summary["step"], checkpoints_dir(job_dir))
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from axon_nb.rank.world.interrupts import StopSignal
from axon_nb.spec.checkpoint_format import SaveTarget
from axon_nb.spec.checkpoint_series import latest, path_for, remove_partial
from axon_nb.spec.job_files import PREEMPTED_EXIT, checkpoints_dir
from axon_nb.spec.notice_signal import notice_signum
from axon_nb.spec.train_spec import TrainSpec

__all__ = ["PREEMPTED_EXIT", "Preemption", "resume_from_checkpoint"]


_early: dict[str, tuple[float, int]] = {}


def hold_notices(signal_name: str, *, sigterm: bool = False) -> None:
    """(A job's rank, from its start) a notice that comes before training begins is kept, not
    lost: the :class:`Preemption` entered later stops the run at its first step, with a
    checkpoint. Main thread only."""

    def keep(signum: int, frame: FrameType | None) -> None:
        _early.setdefault("notice", (time.time(), signum))

    signal.signal(notice_signum(signal_name), keep)
    if sigterm:
        signal.signal(signal.SIGTERM, keep)


class Preemption:
    """While active: the notice signal asks every rank to stop at the next step boundary
    (SIGINT still does, as on a cluster). ``sigterm``: SIGTERM is a notice too (a Slurm batch
    job's preemption; its grace is Slurm's KillWait)."""

    def __init__(self, signal_name: str, *, sigterm: bool = False) -> None:
        notice = notice_signum(signal_name)
        self.signums = [notice, signal.SIGTERM] if sigterm else [notice]
        self.stop = StopSignal()
        self.arrived: float | None = None
        """When the notice came (``time.time()``), or None."""
        self.signum: int | None = None
        """Which signal it was."""
        self._saved: list[Any] = []

    def __enter__(self) -> Preemption:
        self.stop.__enter__()
        if threading.current_thread() is threading.main_thread():  # (signals go there only)
            self._saved = [signal.signal(s, self._notice) for s in self.signums]
        early = _early.pop("notice", None)  # (one that came before: hold_notices)
        if early is not None:
            self.arrived, self.signum = early
            self.stop.requested = True
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, saved in zip(self.signums, self._saved, strict=False):
            signal.signal(signum, signal.SIG_DFL if saved is None else saved)  # (None: C's)
        self.stop.__exit__(*exc)

    def _notice(self, signum: int, frame: FrameType | None) -> None:
        if self.arrived is None:
            self.arrived, self.signum = time.time(), signum
        self.stop.requested = True  # (the loop agrees on the step with every rank)

    def agree(self) -> bool:
        """Every rank, once the run stopped: whether any rank got the notice (a spot notice
        may reach one process only); each then knows its signal and earliest time."""
        import torch
        import torch.distributed as dist

        mine = [float(self.signum or 0), -(self.arrived or float("inf"))]
        said = torch.tensor(mine, dtype=torch.float64)
        if dist.get_backend() == "nccl":
            said = said.cuda()
        dist.all_reduce(said, op=dist.ReduceOp.MAX)
        signum, earliest = said.tolist()
        if signum:
            self.signum, self.arrived = int(signum), -earliest
        return bool(signum)

    def checkpoint(self, name: str, step: int, directory: str | Path) -> dict[str, Any]:
        """Every rank: write run ``name`` at ``step`` into ``directory`` (``step-<n>``); what
        happened (the step, the path, the signal, when it came and when it was saved)."""
        import torch.distributed as dist

        from axon_nb.rank import runtime
        from axon_nb.rank.checkpoint import checkpoint_io

        path = path_for(str(directory), step)
        target = SaveTarget(path=path, partial=f"{path}.partial-preempted", kind="sharded",
                            replaces=None)  # fmt: skip
        error: OSError | None = None
        if dist.get_rank() == 0:
            try:
                Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                target.create_partial()
            except OSError as e:  # (said to every rank: none waits in a barrier)
                error = e
        checkpoint_io.agree(runtime.context(), error, f"start the preemption checkpoint {path}")
        checkpoint_io.save(name, target)
        dist.barrier()
        return {"step": step, "path": path, "notice_at": self.arrived, "saved_at": time.time(),
                "signal": signal.Signals(self.signum).name if self.signum else None}  # fmt: skip


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
