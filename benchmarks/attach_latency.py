"""Time from ``axon_nb.attach`` to a live dashboard holding a long run's whole history.

A 2-rank detached cluster is started by a script that then exits (as a notebook's kernel
may), its run of ``--steps`` steps going on. Once the run has passed ``--history`` steps,
a new process attaches and times (a) ``axon_nb.attach(name)`` alone (the reference: connect
to the controller, register the relays, replay the ranks' output), and (b) attach, then
``cluster.handle("model")`` until its dashboard holds every step the run had done when the
attach began (read from the run's kept stream files), live. Each is repeated ``--repeats``
times, alternating, in the same process. Prints the medians and (b)/(a).

    python benchmarks/attach_latency.py [--steps 12000] [--history 10000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import axon_nb

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

START = """
import os, sys
import torch
from torch import nn
import axon_nb

def make_model():
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))

def loss(output, target):
    return nn.functional.mse_loss(output, target)

g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(4096, 8, generator=g),
                                      torch.randn(4096, 4, generator=g))
cluster = axon_nb.Cluster(n=2, detach=True, name=sys.argv[1], idle_timeout=600).start()
run = cluster.train(model=make_model, data=data, loss=loss, steps=int(sys.argv[2]),
                    batch_size=32, block=False)
while not run.history:  # (the run has reached the ranks)
    import time; time.sleep(0.05)
os._exit(0)
"""


def step_of(name: str) -> int:
    [cluster] = [c for c in axon_nb.clusters() if c.name == name]
    return cluster.runs[-1].step if cluster.runs else 0


def attach_only(name: str) -> float:
    began = time.perf_counter()
    cluster = axon_nb.attach(name, replay=True)
    took = time.perf_counter() - began
    cluster.client.close()
    return took


def attach_with_history(name: str) -> tuple[float, int]:
    """Seconds until the dashboard holds every step done when the attach began; that step."""
    at = step_of(name)
    began = time.perf_counter()
    cluster = axon_nb.attach(name, replay=True)
    handle = cluster.handle("model")
    state = handle.dashboard.state
    while not state.steps or state.steps[-1] < at:
        time.sleep(0.002)
    took = time.perf_counter() - began
    assert state.steps[0] == 1  # (the dashboard's curves thin a long run's points evenly)
    history = handle.history
    assert [h["step"] for h in history[:at]] == list(range(1, at + 1)), len(history)
    cluster.client.close()
    return took, at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12000)
    parser.add_argument("--history", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    name = f"bench-attach-{os.getpid()}"
    subprocess.run([sys.executable, "-c", START, name, str(args.steps)], check=True)
    try:
        while step_of(name) < args.history:
            time.sleep(0.5)
        plain, full, steps = [], [], []
        for _ in range(args.repeats):
            plain.append(attach_only(name))
            took, at = attach_with_history(name)
            full.append(took)
            steps.append(at)
        a, b = statistics.median(plain), statistics.median(full)
        print(f"run at steps {min(steps)}..{max(steps)} of {args.steps} (2 ranks, live)")
        print(f"(a) attach alone:                              {a * 1000:8.1f} ms (median)")
        print(f"(b) attach + dashboard with the whole history: {b * 1000:8.1f} ms (median)")
        print(f"(b)/(a): {b / a:.2f}")
        kept = Path(axon_nb.attach(name, replay=False).detached.root) / "runs" / "model"
        size = sum(p.stat().st_size for p in kept.iterdir())
        print(f"kept run files: {size / 2**20:.1f} MiB")
    finally:
        axon_nb.stop_detached(name)


if __name__ == "__main__":
    main()
