"""IPython magics: thin argument parsing over :class:`axon_nb.Cluster`."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from axon_nb.cluster import Cluster, warm_engines
from axon_nb.cluster.options import (
    ENGINE_KINDS,
    parse_duration,
    parse_gpus,
    parse_hosts,
    read_hostfile,
)  # fmt: skip
from axon_nb.cluster.rank_displays import LiveOutput
from axon_nb.errors import NoClusterError
from axon_nb.spec.placement import BACKENDS


@magics_class
class AxonMagics(Magics):
    """``%axon_cluster``, ``%%axon``, ``%axon_run``, ``%axon_stacks`` and the status magics;
    one cluster per kernel."""

    instance: AxonMagics | None = None
    """The magics of the running kernel (for :func:`current_cluster`)."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.cluster: Cluster | None = None
        AxonMagics.instance = self

    @magic_arguments()
    @argument("n", nargs="?", help="number of ranks to start")
    @argument("--engines", default="mpi", choices=ENGINE_KINDS, help="how engines are launched")
    @argument("--backend", default="auto", choices=BACKENDS, help="torch.distributed backend")
    @argument("--gpus", default=None, help="CUDA devices to use, e.g. 0,1 (default: all)")
    @argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    @argument(
        "--hang-timeout",
        type=float,
        default=None,
        help="show every rank's stacks once after this many seconds without progress",
    )
    @argument("--hosts", default=None, help="start ranks on these hosts over ssh: node1:4,node2:4")
    @argument("--hostfile", default=None, help="a file of host:slots lines, instead of --hosts")
    @argument("--iface", default=None, help="network interface the ranks use across hosts")
    @argument(
        "--oversubscribe",
        action="store_const",
        const=True,
        default=None,
        help="allow more ranks than this host has GPUs (or cores on CPU)",
    )
    @argument("--partition", default=None, help="--engines slurm: the partition to submit to")
    @argument("--time", default=None, help="--engines slurm: the job's time limit, e.g. 2:00:00")
    @argument("--detach", action="store_true", help="outlive this kernel (attach: %%axon_attach)")
    @argument("--name", default=None, help="--detach: the cluster's name (default: made up)")
    @argument("--idle-timeout", default="2h", help="--detach: end after this long unattached")
    @argument(
        "--preempt-signal", default="USR2",
        help="the preemption notice (Slurm's --signal): a run checkpoints and stops on it",
    )  # fmt: skip
    @argument("--list", action="store_true", help="list your detached clusters on this host")
    @argument("--stop", action="store_true", help="stop the running cluster")
    @argument("--restart", action="store_true", help="stop the running cluster, start anew")
    @argument("--status", action="store_true", help="show the running cluster's ranks")
    @argument("--resize", default=None, help="add or remove ranks of the running cluster: N")
    @argument(
        "--add-host", action="append", default=None,
        help="--resize across hosts: the new ranks' HOST:SLOTS (again for more hosts)",
    )  # fmt: skip
    @line_magic
    def axon_cluster(self, line: str) -> None:
        """Start, inspect, restart or stop the kernel's cluster of ranks.

        ::

            In [1]: %axon_cluster 4 --hang-timeout 300   # or --hosts node1:4,node2:4 --iface eth1
            rank  host  pid    device  backend
            0     node  12345  cpu     gloo
            ...
            In [2]: %axon_cluster --status
            In [3]: %axon_cluster --restart
            In [4]: %axon_cluster --stop
            In [5]: %axon_cluster 8 --detach --name lab --idle-timeout 2h   # outlives the kernel
            In [6]: %axon_cluster --list
            In [7]: %axon_cluster --resize 6    # a run in progress goes on with 6 ranks
        """
        args = parse_argstring(self.axon_cluster, line)
        try:
            args.idle_timeout = parse_duration(args.idle_timeout)
        except ValueError as e:
            raise UsageError(f"--idle-timeout: {e}") from None
        if args.list:
            _list_detached()
        elif args.stop:
            self._stop_command()
        elif args.status:
            self._status_command()
        elif args.restart:
            self._restart_command(args)
        elif args.resize is not None or args.add_host:
            self._resize_command(args.resize, args.add_host)
        elif args.n is None:
            raise UsageError("give the number of ranks, e.g. `%axon_cluster 4` (or --status)")
        elif self.cluster is not None and self.cluster.running:
            print(
                f"A cluster with {len(self.cluster.ranks)} ranks is already running; nothing "
                "was changed. Use `%axon_cluster N --restart` to replace it or --stop."
            )
        else:
            self._start(_cluster_from_args(args))

    @magic_arguments()
    @argument("--ranks", default=None, help="run only on these ranks, e.g. 0,2")
    @argument("--no-stream", action="store_true", help="print output when done, not live")
    @cell_magic
    def axon(self, line: str, cell: str) -> None:
        """Run the cell on every rank, in namespaces that persist between cells.

        ``rank``, ``world_size``, ``local_rank`` and ``device`` are predefined. ::

            In [2]: %%axon
               ...: import torch.distributed as dist
               ...: print(dist.get_rank(), world_size, device)
            [rank 0] 0 2 cpu
            [rank 1] 1 2 cpu
        """
        args = parse_argstring(self.axon, line)
        ranks = _parse_ranks(args.ranks)
        parts = self._require_cluster().execute(cell, ranks=ranks, stream=not args.no_stream)
        if args.no_stream:
            LiveOutput(parts, sys.stdout, sys.stderr).finish()
        _show_results(parts)

    @line_magic
    def axon_status(self, line: str) -> None:
        """Show the ranks at a glance: host, device, backend, memory and training runs.

        ::

            In [2]: %axon_status
        """
        from axon_nb.rank.entry import rank_status
        from axon_nb.widgets.frontend import in_notebook
        from axon_nb.widgets.status import status_text, status_widget

        if line.strip():
            raise UsageError("%axon_status takes no arguments")
        rows = self._require_cluster().run(rank_status, stream=False)
        if in_notebook():
            from IPython.display import display

            display(status_widget(rows))
        else:
            print(status_text(rows))

    @magic_arguments()
    @argument("--full", action="store_true", help="also print each rank's main-thread stack")
    @argument("--ranks", default=None, help="only these ranks, e.g. 0,2")
    @line_magic
    def axon_stacks(self, line: str) -> None:
        """Show where every rank is now: its Python stacks and current collective, also while
        the ranks are busy or stuck in a cell or a training run.

        ::

            In [5]: %axon_stacks
            Stacks of 4 ranks at 14:02:11:
              ranks 0, 2, 3 wait in all_reduce #57 (group of 4, 1.0 KiB) for 12 s, at ...
              rank 1 is elsewhere: train.py:42 in load_batch ← train.py:80 in step
        """
        args = parse_argstring(self.axon_stacks, line)
        report = self._require_cluster().stacks(_parse_ranks(args.ranks))
        print(report.format(full=args.full))

    @magic_arguments()
    @argument("collectives", nargs="*", help="all_reduce, all_gather, ... or all (default)")
    @argument("--sizes", default="1K:16M", help="first:last, doubling, e.g. 1K:256M")
    @argument("--iters", type=int, default=10, help="timed calls per size")
    @argument("--warmup", type=int, default=3, help="untimed calls per size first")
    @line_magic
    def axon_bench(self, line: str) -> None:
        """Measure collective bandwidth on the ranks, as nccl-tests does: time per call,
        algorithm and bus bandwidth per size (``cluster.bandwidth``).

        ::

            In [3]: %axon_bench all_reduce --sizes 1K:256M
        """
        args = parse_argstring(self.axon_bench, line)
        try:
            report = self._require_cluster().bandwidth(
                args.collectives or None, args.sizes, iters=args.iters, warmup=args.warmup
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        from axon_nb.widgets.frontend import in_notebook

        if in_notebook():
            from IPython.display import display

            display(report)
        else:
            print(report)

    @line_magic
    def axon_dashboard(self, line: str) -> None:
        """Show the live dashboard of the latest ``cluster.train`` run (e.g. ``block=False``).

        ::

            In [4]: handle = axon_nb.current_cluster().train(..., block=False)
            In [5]: %axon_dashboard
        """
        if line.strip():
            raise UsageError("%axon_dashboard takes no arguments; it shows the latest run")
        run = self._require_cluster().last_run
        if run is None:
            raise UsageError(
                "no training run yet on this cluster: start one with "
                "`axon_nb.current_cluster().train(..., block=False)`"
            )
        run.show()

    @line_magic
    def axon_run(self, line: str) -> None:
        """Run an unmodified torchrun-style script on every rank and stream its output.

        ::

            In [3]: %axon_run train.py --epochs 1
        """
        try:
            argv = shlex.split(line)
        except ValueError as e:  # e.g. "No closing quotation"
            raise UsageError(
                f"cannot read the command line of %axon_run ({e}): close the quotes, e.g. "
                "`%axon_run train.py --name 'my run'`"
            ) from None
        if not argv:
            raise UsageError("give a script to run, e.g. `%axon_run train.py --epochs 1`")
        if argv[0].startswith("-"):
            raise UsageError(
                f"%axon_run has no option {argv[0]!r}: give the script first, then its own "
                "arguments, e.g. `%axon_run train.py --epochs 1`"
            )
        self._require_cluster().run_script(argv[0], argv[1:])

    @line_magic
    def axon_attach(self, line: str) -> None:
        """Attach this kernel to a detached cluster of yours (``axon_nb.attach``): the same
        ranks, their names and models, and its runs (``cluster.handle("model")``).

        ::

            In [1]: %axon_attach lab
        """
        name = line.strip()
        if not name or " " in name:
            raise UsageError("give the cluster's name, e.g. `%axon_attach lab` (see --list)")
        if self.cluster is not None and self.cluster.running and self.cluster.name != name:
            raise UsageError(
                "this kernel already has a cluster (`%axon_cluster --status`): attach from "
                "another kernel, or end this one first with `%axon_cluster --stop` (which "
                "ends it, detached or not)"
            )
        from axon_nb.cluster.attach_api import attach

        cluster = attach(name)
        self.cluster = cluster
        print(cluster.table())

    # -- helpers ---------------------------------------------------------------------------

    def stop_cluster(self, *, keep_warm: bool = False) -> None:
        """Stop the kernel's cluster, if any (``keep_warm``: a start follows at once)."""
        if self.cluster is not None:
            self.cluster.stop(keep_warm=keep_warm)
            self.cluster = None

    def _require_cluster(self) -> Cluster:
        if self.cluster is None or not self.cluster.running:
            raise NoClusterError("no cluster is running: start one first with `%axon_cluster N`")
        return self.cluster

    def _start(self, cluster: Cluster) -> None:
        opts = cluster.options
        print(f"Starting {opts.n} ranks ({opts.engines} engines) ...", flush=True)
        cluster.start()
        self.cluster = cluster
        print(cluster.table())
        print(cluster.exposure())
        if cluster.name is not None:
            print(
                f"Detached as {cluster.name!r}: it outlives this kernel, and any kernel of yours "
                f"attaches with `%axon_attach {cluster.name}`; it ends after "
                f"{opts.idle_timeout:g} s with no kernel attached and no run in progress."
            )

    def _stop_command(self) -> None:
        if self.cluster is None:
            print("No cluster is running.")
            return
        n = len(self.cluster.ranks)
        self.stop_cluster()
        print(f"Stopped the cluster ({n} ranks).")

    def _status_command(self) -> None:
        if self.cluster is None or not self.cluster.running:
            print("No cluster is running. Start one with `%axon_cluster N`.")
            return
        print(repr(self.cluster))
        print(self.cluster.table())

    def _resize_command(self, n: str | None, add_hosts: list[str] | None) -> None:
        if self.cluster is None or not self.cluster.running:
            raise UsageError("no cluster to resize: start one with `%axon_cluster N`")
        try:
            size = int(n) if n is not None else None
        except ValueError:
            raise UsageError(f"--resize takes a number of ranks, got {n!r}: --resize 4") from None
        try:
            self.cluster.resize(size, add_hosts=",".join(add_hosts) if add_hosts else None)
        except ValueError as e:
            raise UsageError(str(e)) from None
        print(self.cluster.table())

    def _restart_command(self, args: Any) -> None:
        if args.n is None and self.cluster is None:
            raise UsageError("no cluster to restart: start one with `%axon_cluster N`")
        new = _cluster_from_args(args) if args.n is not None else None
        if new is None:
            assert self.cluster is not None
            new = Cluster(**dataclasses.asdict(self.cluster.options))
        self.stop_cluster(keep_warm=True)
        warm_engines.ended_on_failure(lambda: self._start(new))


def _cluster_from_args(args: Any) -> Cluster:
    try:
        n = int(args.n)
    except ValueError:
        raise UsageError(
            f"the number of ranks must be a positive integer, got {args.n!r}: "
            "e.g. `%axon_cluster 4`"
        ) from None
    try:
        return Cluster(
            n,
            engines=args.engines,
            backend=args.backend,
            gpus=parse_gpus(args.gpus),
            timeout=args.timeout,
            hang_timeout=args.hang_timeout,
            hosts=_hosts_from_args(args),
            iface=args.iface,
            oversubscribe=args.oversubscribe,
            partition=args.partition,
            time=args.time,
            detach=args.detach,
            name=args.name,
            idle_timeout=args.idle_timeout,
            preempt_signal=args.preempt_signal,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def _list_detached() -> None:
    from axon_nb.cluster.detached import clusters

    found = clusters()
    if not found:
        print("No detached clusters of yours on this host (`%axon_cluster N --detach` starts one).")
    for cluster in found:
        print(cluster)
        print(f"    attach: %axon_attach {cluster.name}")


def _hosts_from_args(args: Any) -> tuple[tuple[str, int], ...] | None:
    if args.hosts is not None and args.hostfile is not None:
        raise ValueError("give --hosts or --hostfile, not both")
    if args.hostfile is not None:
        return read_hostfile(args.hostfile)
    return parse_hosts(args.hosts) if args.hosts is not None else None


def _parse_ranks(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(r) for r in text.split(",")]
    except ValueError:
        raise UsageError(f"--ranks takes comma-separated ranks like 0,2, got {text!r}") from None


def _show_results(parts: dict[int, Any]) -> None:
    """Show each rank's cell result (its displays showed as they came, see
    ``cluster/rank_displays.py``); a result identical on all ranks shows once."""
    results = {rank: _single(part.execute_result) for rank, part in parts.items()}
    texts = {rank: r["data"].get("text/plain") for rank, r in results.items() if r}
    if not texts:
        return
    if len(texts) == len(parts) > 1 and len(set(texts.values())) == 1:
        print(f"Out[all ranks]: {next(iter(texts.values()))}")
        return
    for rank, text in texts.items():
        print(f"Out[rank {rank}]: {text}")


def _single(value: Any) -> Any:
    """A one-rank AsyncResult may still wrap its metadata in a one-item list."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def current_cluster() -> Cluster:
    """The cluster that ``%axon_cluster`` started in this kernel, for the Python API.

    Example::

        In [1]: %axon_cluster 2
        In [2]: cluster = axon_nb.current_cluster()
        In [3]: result = cluster.train(model=make_model, data=ds, steps=100, batch_size=64)
    """
    magics = AxonMagics.instance
    if magics is None or magics.cluster is None or not magics.cluster.running:
        raise NoClusterError(
            "no cluster was started with `%axon_cluster N` in this kernel: run it first, or "
            "create one with `axon_nb.Cluster(n=N).start()`"
        )
    return magics.cluster
