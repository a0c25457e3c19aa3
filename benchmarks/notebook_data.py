"""A dataset built in the notebook: held once per host, against building it on the ranks.

``data=ds`` with a ``TensorDataset`` of ``--mb`` MB made in this process (as a notebook would),
on ``--ranks`` ranks of one host:

1. memory: the ranks' resident memory on the host after two calls with ``data=ds``, beyond
   what they held before: their anonymous (private) memory plus each shared copy once (the
   files they map, counted by inode), against one copy of the dataset (target <= 1.3);
2. time: the second and later ``train`` calls with the same ``ds`` against the callable form
   (``data=make_data``, which builds the same tensors on each rank), alternating, medians
   (target <= 1.5), and against a bare call (a callable building 256 rows: what a call
   costs whatever its data);
3. views: a dataset whose inputs and targets are views of one matrix (a slice of columns
   and the last column, as targets cut from the same array usually are) plus a strided
   NumPy view, after two calls: host memory against the bytes of the spans the views use
   (the slice's whole storage, the column as its own copy; target <= 1.3);
4. for reference, ``data=lambda: ds``: the dataset pickled to every rank on every call (what
   ``data=ds`` cost before), its time and memory the same way (``--no-uncached`` skips it).

Prints the ratios last: ``second call / callable``, ``memory per host / one copy`` and
``views: memory per host / their spans``.

    python benchmarks/notebook_data.py [--mb 205] [--ranks 2] [--steps 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import axon_nb
from axon_nb.rank import entry
from axon_nb.train import notebook_data

WIDTH = 1024


def make_data(rows: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(rows, WIDTH, generator=g), torch.rand(rows, 1, generator=g))


def model() -> nn.Module:
    return nn.Linear(WIDTH, 1)


def held_memory() -> dict[str, Any]:
    """(On a rank) its anonymous memory and the shared copies it maps: inode -> bytes."""
    with open("/proc/self/smaps_rollup") as f:
        anonymous = next(int(line.split()[1]) * 1024 for line in f if line.startswith("Anonymous:"))
    copies: dict[str, int] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 5 and "axon_nb-data-" in fields[5]:
                start, end = (int(a, 16) for a in fields[0].split("-"))
                copies[f"{fields[3]}:{fields[4]}"] = end - start
    return {"anonymous": anonymous, "copies": copies}


def host_bytes(cluster: Any) -> int:
    """The ranks' anonymous memory plus every shared copy once (all ranks on this host)."""
    parts = cluster.run(held_memory, stream=False)
    copies = {k: v for p in parts for k, v in p["copies"].items()}
    return sum(p["anonymous"] for p in parts) + sum(copies.values())


class Views(torch.utils.data.Dataset):
    """Inputs and target cut from one matrix, and a strided NumPy view (``rows`` rows)."""

    def __init__(self, rows: int) -> None:
        base = torch.rand(rows, WIDTH + 1, generator=torch.Generator().manual_seed(0))
        self.x, self.y = base[:, :WIDTH], base[:, WIDTH:]
        self.noise = np.random.default_rng(0).random((2 * rows, 64), np.float32)[::2]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i] + float(self.noise[i, 0]) * 1e-3

    def span_bytes(self) -> int:
        """The base's storage (the slice's span), the column's copy, the NumPy span."""
        rows = len(self.x)
        return rows * (WIDTH + 1) * 4 + rows * 4 + ((2 * rows - 1) * 64) * 4


def timed(cluster: Any, args: dict[str, Any], **more: Any) -> float:
    start = time.perf_counter()
    cluster.train(**args, **more)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=205.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-uncached", dest="uncached", action="store_false")
    opts = parser.parse_args()
    rows = int(opts.mb * 1e6) // (4 * (WIDTH + 1))
    ds = make_data(rows)
    size = sum(t.nbytes for t in ds.tensors)
    print(f"TensorDataset of {rows} rows: {size / 1e6:.0f} MB, {opts.ranks} ranks on one host")
    args = dict(model=model, loss=nn.functional.mse_loss, steps=opts.steps, batch_size=64)

    def make() -> TensorDataset:
        return make_data(rows)

    with axon_nb.Cluster(n=opts.ranks) as cluster:
        cluster.train(**args, data=lambda: make_data(256), name="warm")
        base = host_bytes(cluster)
        first = timed(cluster, args, data=ds, name="cached")
        again = timed(cluster, args, data=ds, name="cached")
        held = host_bytes(cluster) - base
        memory_ratio = held / size
        stats = notebook_data.stats(cluster)
        print(f"data=ds: first call {first:.2f} s (sent {stats.bytes_sent / 1e6:.0f} MB), "
              f"second {again:.2f} s; host memory beyond before: {held / 1e6:.0f} MB")  # fmt: skip

        callable_s, cached_s, bare_s = [], [], []
        for i in range(opts.repeats):
            callable_s.append(timed(cluster, args, data=make, name="built"))
            cached_s.append(timed(cluster, args, data=ds, name="cached"))
            bare_s.append(timed(cluster, args, data=lambda: make_data(256), name="warm"))
            print(f"  round {i + 1}: callable {callable_s[-1]:.2f} s, data=ds "
                  f"{cached_s[-1]:.2f} s, bare call {bare_s[-1]:.2f} s", flush=True)  # fmt: skip
        assert notebook_data.stats(cluster).bytes_sent == stats.bytes_sent  # nothing sent again

        for name in ("built", "cached"):
            cluster.run(entry.drop_run, name, stream=False)
        notebook_data.forget(cluster)
        views = Views(rows)
        base = host_bytes(cluster)
        timed(cluster, args, data=views, name="views")
        timed(cluster, args, data=views, name="views")
        views_held = host_bytes(cluster) - base
        views_ratio = views_held / views.span_bytes()
        print(f"views: spans {views.span_bytes() / 1e6:.0f} MB, host memory beyond before "
              f"{views_held / 1e6:.0f} MB")  # fmt: skip
        cluster.run(entry.drop_run, "views", stream=False)
        notebook_data.forget(cluster)

        if opts.uncached:
            for name in ("built", "cached"):
                cluster.run(entry.drop_run, name, stream=False)
            notebook_data.forget(cluster)
            base = host_bytes(cluster)
            slow = timed(cluster, args, data=lambda: ds, name="uncached")
            slow_held = host_bytes(cluster) - base
            print(f"uncached (data=lambda: ds): {slow:.2f} s per call, host memory "
                  f"{slow_held / 1e6:.0f} MB = {slow_held / size:.2f} copies")  # fmt: skip

    time_ratio = statistics.median(cached_s) / statistics.median(callable_s)
    print(f"callable form {statistics.median(callable_s):.2f} s, data=ds (second and later) "
          f"{statistics.median(cached_s):.2f} s")  # fmt: skip
    bare_ratio = statistics.median(cached_s) / statistics.median(bare_s)
    print(f"second call / bare call (a callable building 256 rows) = {bare_ratio:.2f}")
    print(f"second call / callable = {time_ratio:.2f} (target <= 1.5)")
    print(f"memory per host / one copy = {memory_ratio:.2f} (target <= 1.3)")
    print(f"views: memory per host / their spans = {views_ratio:.2f} (target <= 1.3)")


if __name__ == "__main__":
    main()
