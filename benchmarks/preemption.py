"""A preempted batch job: seconds from the notice to a complete checkpoint, and the steps lost.

A 2-rank torchrun job (``axon_nb.submit``, ``requeue=True``) trains a small model whose step
takes about ``--step-s``; once it has done ``--at`` steps it gets the notice (SIGUSR2 to its
supervisor, as a spot notice or ``scancel --signal=USR2`` would), every rank finishes the step
in flight, checkpoints, exits, and the job is relaunched and goes on. Printed: notice to
checkpoint (s), the step the ranks had published when the notice came and the checkpoint's
step (steps lost: published steps after the checkpoint, target 0), the relaunch until the first
new step (s), and the job's wall time over the same job's without a notice (the reference,
measured in the same run).

With ``--launcher slurm`` (root, Debian's slurm-wlm: ``make test`` installs it) the job runs
on the tests' private Slurm of two namespaced hosts (``tests/slurm_local.py``), one rank on
each, and the notice is ``scancel --signal=USR2``; the relaunch includes Slurm's requeue
(``cred_expire``: 10 s there, 120 s by default).

    python benchmarks/preemption.py [--steps 60] [--at 20] [--step-s 0.05] [--launcher slurm]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import axon_nb

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))


def slow_loss(seconds: float):  # type: ignore[no-untyped-def]
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        time.sleep(seconds)
        return nn.functional.mse_loss(output, target)

    return loss


def run(args: argparse.Namespace, root: Path, notice: bool) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(2048, 8, generator=g),
                                          torch.randn(2048, 4, generator=g))  # fmt: skip
    began = time.monotonic()
    where: dict[str, Any] = {"launcher": args.launcher}
    if args.launcher == "slurm":
        where.update(nodes=2, iface="axeth0")
    job = axon_nb.submit(model=make_model, data=data, loss=slow_loss(args.step_s),
                         steps=args.steps, batch_size=32, ranks=2, requeue=True,
                         job_dir=root / ("notice" if notice else "reference"),
                         **where)  # fmt: skip
    figures: dict[str, float] = {}
    if notice:
        while len(job.history) < args.at:
            time.sleep(0.01)
        published = job.history[-1]["step"]
        sent = time.time()
        if args.launcher == "slurm":
            subprocess.run(["scancel", "--signal=USR2", job.id], check=True, timeout=30)
        else:
            supervisor = json.loads((job.dir / "state.json").read_text())["supervisor_pid"]
            os.kill(int(supervisor), signal.SIGUSR2)
        state = job.dir / "state.json"
        while not json.loads(state.read_text()).get("preemptions"):
            time.sleep(0.01)
        saved = json.loads(state.read_text())["preemptions"][0]
        figures.update(notice_to_checkpoint_s=saved["saved_at"] - sent,
                       published_at_notice=published, checkpoint_step=saved["step"])  # fmt: skip
        while not [h for h in job.history if h["step"] > saved["step"]]:
            time.sleep(0.01)
        figures["relaunch_to_next_step_s"] = time.time() - saved["saved_at"]
    job.wait()
    figures["wall_s"] = time.monotonic() - began
    return figures


@contextlib.contextmanager
def _launcher(name: str) -> Iterator[None]:
    """Nothing for torchrun; the tests' 2-node Slurm for slurm."""
    if name != "slurm":
        yield
        return
    tests = Path(__file__).resolve().parent.parent / "tests"
    sys.path.insert(0, str(tests))
    from netns_hosts import NetnsHosts
    from slurm_local import LocalSlurm

    os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parent)  # (this file's functions)
    with NetnsHosts(2) as hosts, LocalSlurm(hosts):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--at", type=int, default=20)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--launcher", choices=("torchrun", "slurm"), default="torchrun")
    args = parser.parse_args()
    with _launcher(args.launcher), tempfile.TemporaryDirectory(prefix="axon-preemption-") as tmp:
        reference = run(args, Path(tmp), notice=False)
        noticed = run(args, Path(tmp), notice=True)
    lost = max(0, int(noticed["published_at_notice"]) - int(noticed["checkpoint_step"]))
    print(f"notice -> complete checkpoint: {noticed['notice_to_checkpoint_s']:.2f} s")
    print(f"published at the notice: step {noticed['published_at_notice']:.0f}; "
          f"checkpoint: step {noticed['checkpoint_step']:.0f}; steps lost: {lost}")  # fmt: skip
    print(
        f"checkpoint -> first step after the relaunch: {noticed['relaunch_to_next_step_s']:.1f} s"
    )
    print(f"wall: {noticed['wall_s']:.1f} s with the notice, {reference['wall_s']:.1f} s without; "
          f"ratio {noticed['wall_s'] / reference['wall_s']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
