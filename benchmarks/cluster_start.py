"""Time from `%axon_cluster 4` to the first completed all-reduce, against a hand-written baseline.

The baseline starts a plain ipyparallel MPI cluster and initializes the process group itself
(rank 0 picks a port, MPI shares it, gloo init, one all-reduce). Both run alternately in the
same process; the last line is the ratio of medians (axon_nb / baseline). Target: <= 1.10.

    python benchmarks/cluster_start.py [--ranks 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ipyparallel as ipp
from IPython.core.interactiveshell import InteractiveShell

from axon_nb.cluster.launchers import find_mpiexec


def _baseline_join() -> float:
    import datetime
    import os
    import socket

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(comm.bcast(port)))
    dist.init_process_group(
        "gloo",
        rank=comm.Get_rank(),
        world_size=comm.Get_size(),
        timeout=datetime.timedelta(seconds=300),
    )
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def baseline(n: int) -> float:
    start = time.perf_counter()
    cluster = ipp.Cluster(n=n, engines="mpi", log_level=40)
    cluster.config.MPIEngineSetLauncher.mpi_cmd = [find_mpiexec()]
    client = cluster.start_and_connect_sync(activate=False)
    try:
        assert client[:].apply_sync(_baseline_join) == [float(n)] * n
        return time.perf_counter() - start
    finally:
        cluster.stop_cluster_sync()


def axon(shell: InteractiveShell, n: int) -> float:
    start = time.perf_counter()
    shell.run_line_magic("axon_cluster", str(n))
    cell = "import torch\nt = torch.ones(1)\ntorch.distributed.all_reduce(t)"
    shell.run_cell_magic("axon", "--no-stream", cell)
    elapsed = time.perf_counter() - start
    shell.run_line_magic("axon_cluster", "--stop")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    shell = InteractiveShell.instance()
    shell.extension_manager.load_extension("axon_nb")
    ours, theirs = [], []
    for i in range(args.repeats):
        # alternate who goes first, so neither always gets the warmer caches
        pair = [("axon", lambda: axon(shell, args.ranks)), ("base", lambda: baseline(args.ranks))]
        for name, run in pair if i % 2 == 0 else pair[::-1]:
            seconds = run()
            (ours if name == "axon" else theirs).append(seconds)
            print(f"run {i} {name:5s} {seconds:6.2f} s", flush=True)
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"axon_nb median {a:.2f} s, baseline median {b:.2f} s ({args.ranks} ranks)")
    print(f"ratio axon_nb/baseline: {a / b:.3f}")


if __name__ == "__main__":
    main()
