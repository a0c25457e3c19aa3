"""Resizing a cluster that holds a trained run, against what it replaces: a checkpoint, a
restart at the new size and a load.

Both go from 2 ranks to 4 and back, each ending with one more training step of the run on
the new world, measured alternately in the same run (the machine is noisy):

- resize: ``cluster.resize(n)``, then ``train(..., resume=True, steps=1)`` (which lays the
  moved run out on the new world);
- restart: ``cluster.save(path, "sharded")``, ``cluster.restart(n)``, ``train(..., steps=0)``
  to build the run, ``cluster.load(path)``, then ``train(..., resume=True, steps=1)``.

The last line is the ratio of medians (resize / restart); below 1.0 the resize is faster.

    python benchmarks/resize.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import axon_nb
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

RUN: dict[str, Any] = dict(
    model=functools.partial(GPT, GPTConfig(n_layer=4, n_embd=128, n_head=4, block_size=64)),
    data=functools.partial(token_dataset, 2048, block_size=64, vocab_size=64),
    loss=lm_loss,
    batch_size=16,
    optimizer=("adamw", {"lr": 1e-3}),
)


def by_resize(cluster: axon_nb.Cluster, n: int, _: str) -> None:
    cluster.resize(n)
    cluster.train(**RUN, steps=1, resume=True)


def by_restart(cluster: axon_nb.Cluster, n: int, directory: str) -> None:
    path = os.path.join(directory, f"to-{n}-{time.monotonic_ns()}")
    cluster.save(path, "sharded")
    cluster.restart(n)
    cluster.train(**RUN, steps=0)
    cluster.load(path)
    cluster.train(**RUN, steps=1, resume=True)


def timed(way: Callable[[axon_nb.Cluster, int, str], None], cluster: axon_nb.Cluster,
          n: int, directory: str) -> float:  # fmt: skip
    started = time.perf_counter()
    way(cluster, n, directory)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("AXON_NB_OVERSUBSCRIBE", "1")  # (4 ranks on a 2-core machine)
    seconds: dict[str, list[float]] = {"resize": [], "restart": []}
    with tempfile.TemporaryDirectory() as directory, axon_nb.Cluster(n=2) as cluster:
        cluster.train(**RUN, steps=2)
        for _ in range(args.repeats):
            for name, way in (("resize", by_resize), ("restart", by_restart)):
                there, back = timed(way, cluster, 4, directory), timed(way, cluster, 2, directory)
                seconds[name].append(there + back)
                print(f"{name}: 2 -> 4 {there:.2f} s, 4 -> 2 {back:.2f} s", file=sys.stderr)
    resize, restart = (statistics.median(seconds[k]) for k in ("resize", "restart"))
    print(f"median round trip 2 -> 4 -> 2 ranks, a step on each: resize {resize:.2f} s, "
          f"checkpoint + restart + load {restart:.2f} s")  # fmt: skip
    print(f"ratio resize / restart: {resize / restart:.2f}")


if __name__ == "__main__":
    main()
