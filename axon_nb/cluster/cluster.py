"""``Cluster``: a set of persistent ranks (ipyparallel engines) joined in one torch world."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp
import psutil

from axon_nb.cluster import hangs, reaper, startup, stopping
from axon_nb.cluster.control import Control, held_interrupts
from axon_nb.cluster.dask_on_ranks import DaskOnRanks
from axon_nb.cluster.hangs import ANSWER_S, HangWatch, WatchDir
from axon_nb.cluster.host_fit import check_fits_here
from axon_nb.cluster.lab_registry import LabRegistry
from axon_nb.cluster.launchers import CONTROLLER_ARGS, LAUNCHERS
from axon_nb.cluster.logs import ClusterLog
from axon_nb.cluster.options import ClusterOptions, parse_hosts
from axon_nb.cluster.sending import call_args
from axon_nb.cluster.stacks import StackReport
from axon_nb.cluster.waiting import results, wait_for_ranks
from axon_nb.errors import (
    AxonError,
    ClusterBrokenError,
    ClusterStartError,
    NoClusterError,
    RankDiedError,
)
from axon_nb.rank import entry
from axon_nb.rank.watch import NATIVE_SIGNAL
from axon_nb.spec.stop_waits import ASK_S

if TYPE_CHECKING:
    import distributed

    from axon_nb.checkpoint import Checkpoint
    from axon_nb.cluster.bandwidth import BandwidthReport
    from axon_nb.train import TrainHandle, TrainResult
    from axon_nb.train.compare import Comparison


class Cluster:
    """Persistent ranks for distributed PyTorch, started with MPI and joined by torch.distributed.

    Example::

        import axon_nb

        def hello(x):
            import torch.distributed as dist
            return dist.get_rank() * x

        with axon_nb.Cluster(n=4) as cluster:
            print(cluster.run(hello, 10))   # [0, 10, 20, 30]
    """

    def __init__(
        self,
        n: int,
        *,
        engines: str = "mpi",
        backend: str = "auto",
        gpus: Sequence[int] | None = None,
        timeout: float = 300.0,
        start_timeout: float = 180.0,
        hang_timeout: float | None = None,
        hosts: Sequence[tuple[str, int]] | str | None = None,
        iface: str | None = None,
        oversubscribe: bool | None = None,
        partition: str | None = None,
        time: str | None = None,
    ) -> None:
        if isinstance(hosts, str):
            hosts = parse_hosts(hosts)
        self.options = ClusterOptions(
            n=n,
            engines=engines,
            backend=backend,
            gpus=tuple(gpus) if gpus is not None else None,
            timeout=timeout,
            start_timeout=start_timeout,
            hang_timeout=hang_timeout,
            hosts=tuple((str(h), int(c)) for h, c in hosts) if hosts is not None else None,
            iface=iface,
            **({} if oversubscribe is None else {"oversubscribe": oversubscribe}),
            partition=partition,
            time=time,
        )
        self._ipp: ipp.Cluster | None = None
        self._watch: WatchDir | None = None
        self._client: ipp.Client | None = None
        self._reaper: Any = None
        self._broken: str | None = None
        self._dead: set[int] = set()
        self.ranks: list[dict[str, Any]] = []
        """One summary per rank (rank, host, pid, device, backend, ...), in rank order."""
        self._dask = DaskOnRanks()
        self._dask_rows: list[Any] = []
        self.bandwidth_results: BandwidthReport | None = None
        """The latest :meth:`bandwidth` figures."""
        self.last_run: TrainHandle | None = None
        """The latest ``train()`` call's handle (``%axon_dashboard`` shows its dashboard)."""
        self._registry: LabRegistry | None = None
        """This cluster's entry in JupyterLab's Axon sidebar (in a Jupyter kernel)."""
        self.log: ClusterLog | None = None
        """The log file of the latest start: controller, MPI launcher and engine output."""

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True once the world is joined and until :meth:`stop`."""
        return self._client is not None and bool(self.ranks)

    @property
    def client(self) -> ipp.Client:
        """The ipyparallel client connected to the ranks (engine id == rank)."""
        if self._client is None:
            raise NoClusterError(
                "the cluster is not running: call cluster.start() or use `%axon_cluster N`"
            )
        return self._client

    def start(self) -> Cluster:
        """Start the controller and engines, and join every rank to the torch world.

        On any failure everything started so far is stopped before the error is raised.
        """
        if self._ipp is not None:
            raise AxonError("the cluster is already running; stop() or restart() it first")
        opts = self.options
        check_fits_here(opts)  # refused before anything is launched
        self.log = ClusterLog.create()
        cluster = ipp.Cluster(
            n=opts.n, engines=opts.engines, log=self.log.logger, controller_args=CONTROLLER_ARGS
        )
        # may raise (no mpiexec) before anything starts
        LAUNCHERS[opts.engines](cluster, opts, str(self.log.path))
        self._ipp = cluster
        try:
            self._watch = WatchDir.create()
            cluster.start_controller_sync()
            cluster.start_engines_sync(opts.n)
            self._reaper = reaper.spawn(
                os.getpid(), cluster.cluster_file, str(self._watch.path), self._launcher_pids()
            )
            self._client = cluster.connect_client_sync()
            startup.wait_for_engines(cluster, self._client, opts, self.log)
            self.ranks = startup.join_world(
                self._client,
                opts,
                self._wait_start,
                str(self._watch.path),
                kernel_addr=cluster.controller_ip or None,
            )
        except BaseException as e:
            self.stop()
            if isinstance(e, AxonError | KeyboardInterrupt):
                raise
            raise ClusterStartError(f"{e}\n{startup.log_tail(self.log)}") from e
        self._broken = None
        self._dead = set()
        # Before ipyparallel's own exit hook (registered earlier, so run later): a stop that
        # ends busy ranks too (see stop_waits). A killed kernel is the reaper's.
        atexit.register(self.stop)
        self._registry = LabRegistry.for_kernel(self)
        if self._registry is not None:
            self._registry.start()
        return self

    def stop(self) -> None:
        """Stop engines and controller. Safe to call twice. A Ctrl-C meanwhile is held until
        everything is stopped (an interrupted stop would leave processes behind)."""
        with held_interrupts() as held:
            self._stop()
        if held.arrived:
            print("(Ctrl-C was held until the cluster had stopped)", file=sys.stderr)

    def _stop(self) -> None:
        atexit.unregister(self.stop)
        if self._registry is not None:
            self._registry.close()
            self._registry = None
        self._dask_rows = []
        self._dask.close()
        engines = self._launcher_pids(controller=False)
        tree = stopping.process_tree(engines)  # (before any of it ends: see stopping.py)
        if self._ipp is not None and self.log is not None:
            startup.copy_launcher_output(self._ipp, self.log)
        if self._client is not None:
            # Ask first: idle engines exit 0 at once. A busy engine acts on the request only
            # when its cell ends, and survivors of a dead rank may be stuck: no use asking.
            with contextlib.suppress(Exception):
                if not self._broken and not self._client.outstanding:
                    self._client.shutdown(targets="all", block=False)
                    stopping.wait_gone(tree, ASK_S)
            self._client.close()
            self._client = None
        stopping.terminate_then_kill(tree, engines)  # (returns at once if all are gone)
        if self._ipp is not None:
            controller = self._launcher_pids(engines=False)
            stopping.terminate_then_kill(stopping.process_tree(controller), controller)
            with contextlib.suppress(Exception):
                self._ipp.stop_cluster_sync()  # ipyparallel's files and bookkeeping
            self._ipp = None
        if self._reaper is not None:
            self._reaper.wait(timeout=10)  # it exits once the cluster file is gone
            self._reaper = None
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        if self.log is not None:
            self.log.close()
        self.ranks = []

    def _launcher_pids(self, *, engines: bool = True, controller: bool = True) -> list[int]:
        """Pids of the processes ipyparallel started: the engine launchers (``mpiexec``, or
        each local engine's parent) and the controller."""
        if self._ipp is None:
            return []
        launchers = []
        for engine_set in self._ipp.engines.values() if engines else []:
            # (a local engine set is one launcher per engine; an MPI set is one mpiexec)
            launchers += getattr(engine_set, "launchers", {}).values() or [engine_set]
        if controller and self._ipp.controller is not None:
            launchers.append(self._ipp.controller)
        return [
            launcher.process.pid
            for launcher in launchers
            if getattr(launcher, "process", None) is not None
        ]

    def restart(self, n: int | None = None) -> Cluster:
        """Stop everything and start fresh ranks with the same options (``n`` ranks if given).
        Example::

            cluster.restart(n=2)   # go on with 2 ranks
        """
        if n is not None:
            self.options = dataclasses.replace(self.options, n=n)  # checked before stopping
        self.stop()
        return self.start()

    def __enter__(self) -> Cluster:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        if self._broken:
            state = "broken"
        return f"<axon_nb.Cluster n={self.options.n} engines={self.options.engines} {state}>"

    # -- running code ----------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        ranks: Sequence[int] | None = None,
        stream: bool = True,
        **kwargs: Any,
    ) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank (or ``ranks``); results in rank order.

        Output streams while it runs, labelled by rank. Ctrl-C interrupts the ranks and leaves
        the cluster usable. Example::

            cluster.run(lambda: torch.distributed.get_rank())   # [0, 1, 2, 3]
        """
        targets = self.targets(ranks)
        ar, interrupted = self.apply(targets, fn, *args, **kwargs)
        return results(self.wait(ar, targets, stream=stream, interrupted=interrupted))

    def execute(
        self, code: str, *, ranks: Sequence[int] | None = None, stream: bool = True
    ) -> dict[int, ipp.AsyncResult]:
        """Run ``code`` in every rank's persistent namespace; returns the finished parts by rank.

        Example::

            cluster.execute("x = rank * 2")
            cluster.run(lambda: x)   # NameError: functions see their own globals, not the cell's
        """
        targets = self.targets(ranks)
        with held_interrupts() as held:
            ar = self.view(targets).execute(code, silent=False, block=False)
        return self.wait(ar, targets, stream=stream, interrupted=held.arrived)

    def run_script(self, path: str, args: Sequence[str] = ()) -> list[int]:
        """Run an unmodified torchrun-style script on every rank (fresh processes, own world).

        Returns each rank's exit code (all 0, else :class:`RankError`). Example::

            cluster.run_script("train.py", ["--epochs", "1"])
        """
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such script: {path!r} (relative to {os.getcwd()})")
        targets = self.targets(None)
        ar, interrupted = self.apply(
            targets, entry.run_script, os.path.abspath(path), list(args), os.getcwd()
        )
        return results(self.wait(ar, targets, stream=True, interrupted=interrupted))

    # -- training and checkpoints: functions in their own packages ------------------------

    def train(self, *args: Any, **kwargs: Any) -> TrainResult | TrainHandle:
        """Train on the ranks: :func:`axon_nb.train.train` on this cluster (same arguments).

        Example::

            result = cluster.train(model=make_model, data=ds, strategy=DDP(), steps=100,
                                   batch_size=32)
        """
        from axon_nb.train import train

        return train(self, *args, **kwargs)

    def compare(self, strategies: list[Any], **kwargs: Any) -> Comparison:
        """Train each strategy a few steps on these ranks and show them side by side:
        :func:`axon_nb.train.compare.compare` (same arguments). Example::

            cluster.compare([DDP(), ZeRO(stage=2), FSDP()], model=make_model, data=ds,
                            batch_size=32, steps=20)
        """
        from axon_nb.train.compare import compare

        return compare(self, strategies, **kwargs)

    def profile(self, model: Any, data: Any, loss: Any = None, *, samples: int = 4) -> Any:
        """Measure ``model`` on rank 0 (one forward and backward of ``samples`` items of
        ``data``): the :class:`~axon_nb.estimate.ModelProfile` that
        :func:`axon_nb.estimate.predict` and :func:`axon_nb.advise` work from. Example::

            profile = cluster.profile(model=make_gpt, data=ds, loss=lm_loss)
            axon_nb.estimate.predict(profile, FSDP(), world_size=8, batch_size=64)
        """
        from axon_nb.estimate import ModelProfile

        [measured] = self.run(entry.profile_model, model, data, loss, samples, ranks=[0],
                              stream=False)  # fmt: skip
        return ModelProfile.from_dict(measured)

    def advise(
        self, model: Any, data: Any = None, loss: Any = None, *, device_memory: str | float,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        """:func:`axon_nb.advise` for this cluster's world and hosts, with the model profiled
        on rank 0 and the links measured by :meth:`bandwidth` (when it has run). Example::

            cluster.bandwidth("all_reduce", sizes="1M:64M")
            cluster.advise(make_gpt, ds, lm_loss, device_memory="80GB", batch_size=64)
        """
        from axon_nb.estimate import advise

        kwargs.setdefault("bandwidth", self.bandwidth_results)
        return advise(
            profile=self.profile(model, data, loss), world_size=len(self.targets()),
            hosts=max(1, len(self.targets()) // self.ranks_per_host),
            device_memory=device_memory, **kwargs,
        )  # fmt: skip

    def bandwidth(self, *args: Any, **kwargs: Any) -> BandwidthReport:
        """Collective bandwidth and latency on these ranks, as nccl-tests measures them:
        :func:`axon_nb.cluster.bandwidth.bandwidth` (same arguments). Example::

            cluster.bandwidth("all_reduce", sizes="1M:64M")   # a table and a plot
        """
        from axon_nb.cluster.bandwidth import bandwidth

        return bandwidth(self, *args, **kwargs)

    def save(self, *args: Any, **kwargs: Any) -> Checkpoint:
        """Save a run: :func:`axon_nb.checkpoint.save` on this cluster (same arguments).

        Example::

            cluster.save("ckpt/step100", kind="sharded")
        """
        from axon_nb.checkpoint import save

        return save(self, *args, **kwargs)

    def load(self, *args: Any, **kwargs: Any) -> Checkpoint:
        """Load a checkpoint: :func:`axon_nb.checkpoint.load` on this cluster (same arguments).

        Example::

            cluster.load("ckpt/step100")
        """
        from axon_nb.checkpoint import load

        return load(self, *args, **kwargs)

    def rescue(self, *args: Any, **kwargs: Any) -> Checkpoint:
        """Save what the surviving ranks hold after a rank died (see
        ``axon_nb.checkpoint.on_cluster.rescue``)."""
        from axon_nb.checkpoint import on_cluster

        return on_cluster.rescue(self, *args, **kwargs)

    def survivors(self) -> tuple[list[int], list[int]]:
        """``(alive, dead)`` ranks: a rank is dead once a call saw it die, once the controller
        dropped its engine, or (on this host) once its process is gone. Example::

            cluster.survivors()   # ([0, 2, 3], [1])
        """
        here = socket.gethostname()
        registered = set(self.client.ids)
        dead = [
            r["rank"]
            for r in self.ranks
            if r["rank"] in self._dead
            or r["rank"] not in registered
            or (r.get("host") == here and not psutil.pid_exists(r["pid"]))
        ]
        return [r["rank"] for r in self.ranks if r["rank"] not in dead], dead

    def interrupt(self, ranks: Sequence[int] | None = None) -> None:
        """Send SIGINT to the ranks (what Ctrl-C in a running cell does)."""
        Control(self.client, []).interrupt(self.targets(ranks))

    def stacks(
        self, ranks: Sequence[int] | None = None, *, timeout: float = ANSWER_S
    ) -> StackReport:
        """Where every rank (or ``ranks``) is now: each thread's Python stack and the current
        or last collective, also while the ranks are busy or stuck (what ``%axon_stacks`` shows).

        Ranks that do not answer within ``timeout`` seconds (a rank holding the GIL in native
        code, or a dead one) are sent SIGUSR1, on which ``faulthandler`` dumps their stacks.
        Example::

            report = cluster.stacks()
            print(report)            # ranks 0, 2, 3 wait in all_reduce #57 ...
            print(report.stacks[1])  # rank 1's main-thread stack
        """
        if not self.running or self._watch is None:
            raise NoClusterError(
                "no cluster is running: start one with `%axon_cluster N` or "
                "`axon_nb.Cluster(n=N).start()`"
            )
        world = list(range(len(self.ranks)))  # a broken world can still be inspected
        targets = world if ranks is None else sorted(set(ranks))
        if not targets or not set(targets) <= set(world):
            raise ValueError(
                f"ranks must be a non-empty subset of 0..{len(world) - 1}, got {list(ranks or [])}"
            )
        control = Control(self.client, world)
        return hangs.collect(
            self._watch,
            targets,
            signal_native=lambda missing: control.signal(missing, NATIVE_SIGNAL),
            timeout=timeout,
        )

    def dask(self) -> distributed.Client:
        """A ``distributed.Client`` whose workers are the ranks (one per rank, in its engine
        process), its scheduler in the controller; bound like the rest of the cluster. Made on
        first use and again after a restart; stopped with the cluster. Example::

            client = cluster.dask()          # shows the dask dashboard link in a notebook
            df = dd.read_parquet("data/*.parquet").persist()   # read by the ranks
        """
        _ = self.client  # raises when the cluster is not running
        return self._dask.ensure(self)

    def hold_dask_rows(self, futures: list[Any]) -> None:
        """Keep the dask futures of the latest run's rows alive (the previous run's go)."""
        self._dask_rows = list(futures)

    def exposure(self) -> str:
        """One line: what the cluster's processes listen on, beyond this kernel. Example::

        cluster.exposure()   # 'Listening on loopback only: ...'
        """
        if not self.ranks:
            return "Not running: nothing listens."
        stores = {r.get("store", "") for r in self.ranks}
        dask = (
            " The dask scheduler and its dashboard (cluster.dask()) bind the controller's "
            "address, each rank's worker its own."
            if self._dask.client is not None
            else ""
        )
        if not self.options.multi_host:
            return (
                "Listening on loopback only: the controller, MPI and gloo bind 127.0.0.1, and the "
                "ranks meet through a store file in an owner-only directory." + dask
            )
        controller = self._ipp.controller_ip if self._ipp is not None else "?"
        return (
            f"Listening on the ranks' network: the controller on {controller}, the rendezvous "
            f"store on {', '.join(sorted(stores))}, gloo and MPI on each rank's address; "
            "also hydra's mpiexec on every interface of this host (MPICH cannot narrow it)." + dask
        )

    def table(self) -> str:
        """The ranks as a text table: rank, host, pid, device, backend."""
        rows = [("rank", "host", "pid", "device", "backend")]
        rows += [
            (str(r["rank"]), r["host"], str(r["pid"]), r["device"], r["backend"])
            for r in self.ranks
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
        )

    @property
    def ranks_per_host(self) -> int:
        """Ranks on each host (rank 0's host), e.g. FSDP hybrid sharding's default group."""
        return int(self.ranks[0]["local_world_size"]) if self.ranks else 1

    # -- internals -------------------------------------------------------------------------

    def apply(
        self, targets: list[int], fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> tuple[ipp.AsyncResult, bool]:
        """Send ``fn(*args, **kwargs)`` to ``targets`` without waiting: its ``AsyncResult``, and
        whether a Ctrl-C came while sending (held back; pass it to :meth:`wait`).

        Every feature sends its work this way (``cluster/sending.py``), so functions defined
        in the notebook work everywhere."""
        with held_interrupts() as held:
            ar = self.view(targets).apply_async(*call_args(fn, args, kwargs))
        return ar, held.arrived

    def view(self, targets: list[int]) -> ipp.DirectView:
        """A view on ``targets`` (see ``startup.view``: one rank is addressed by its id)."""
        return startup.view(self.client, targets)

    def targets(self, ranks: Sequence[int] | None = None) -> list[int]:
        """``ranks`` checked against the running world (all ranks for None), sorted."""
        if not self.running:
            raise NoClusterError(
                "no cluster is running: start one with `%axon_cluster N` or "
                "`axon_nb.Cluster(n=N).start()`"
            )
        if self._broken:
            raise ClusterBrokenError(
                f"{self._broken}. Run `%axon_cluster --restart` (or cluster.restart()) to "
                "start fresh ranks"
            )
        world = list(range(len(self.ranks)))
        if ranks is None:
            return world
        bad = [r for r in ranks if r not in world]
        if bad or not ranks:
            raise ValueError(
                f"ranks must be a non-empty subset of 0..{len(world) - 1}, got {list(ranks)}"
            )
        return sorted(set(ranks))

    def wait(
        self,
        ar: ipp.AsyncResult,
        targets: list[int],
        *,
        stream: bool,
        timeout: float | None = None,
        watch_hangs: bool = True,
        **options: Any,
    ) -> dict[int, ipp.AsyncResult]:
        """Wait for ``ar`` (one message per rank of ``targets``) as ``waiting.wait_for_ranks``
        does, and keep the cluster's state: a dead rank breaks it, released ranks re-form it.

        With the cluster's ``hang_timeout`` and ``watch_hangs``, the ranks' stacks are shown
        once when no rank finishes or prints for that long."""
        world = list(range(len(self.ranks))) or targets
        joined = self._watch is not None and bool(self.ranks)  # (not while starting)
        control = Control(self.client, world, self.stacks if joined else None)
        hang = None
        if watch_hangs and self.options.hang_timeout is not None and self._watch is not None:
            hang = HangWatch(
                self.options.hang_timeout,
                lambda s: self.report_hang(s, progress="no rank finished or printed"),
            )
        try:
            return wait_for_ranks(
                ar, targets, control=control, stream=stream, timeout=timeout, hang=hang, **options
            )
        except RankDiedError as e:
            self._dead.add(e.rank)
            self._broken = f"rank {e.rank} died"
            raise
        finally:
            if control.released and not self._broken and self.ranks:
                self._reform_world()

    def report_hang(self, seconds: float, *, progress: str) -> StackReport | None:
        """Print every rank's stacks to stderr after ``seconds`` without ``progress`` (what
        did not happen, e.g. "no rank finished a step"); returns the report (None if it could
        not be taken). Example::

            cluster.report_hang(300, progress="no rank finished a step")
        """
        try:
            report = self.stacks()
        except Exception as e:  # a report is a diagnosis; never let it end the wait
            print(f"No progress for {seconds:.0f} s; the stacks could not be taken: {e}",
                  file=sys.stderr)  # fmt: skip
            return None
        print(
            f"No progress for {seconds:.0f} s ({progress}). {report}\n"
            f"Still waiting: a collective stuck past --timeout ({self.options.timeout:g} s) "
            "fails with an error; interrupt the kernel to stop the ranks now.",
            file=sys.stderr,
            flush=True,
        )
        return report

    def _reform_world(self) -> None:
        """Every rank leaves the severed process group and joins a fresh one."""
        print(
            "Ranks had stopped in different collectives, so the process group was re-formed. "
            "Objects built on the old group (DDP models, device meshes) must be rebuilt.",
            file=sys.stderr,
        )
        port = self.client[0].apply_sync(entry.free_port)
        targets = list(range(len(self.ranks)))
        ar = self.view(targets).apply_async(entry.reform, port)
        parts = wait_for_ranks(
            ar, targets, control=Control(self.client, []), timeout=self.options.start_timeout
        )
        self.ranks = results(parts)

    def _wait_start(self, ar: ipp.AsyncResult, targets: list[int]) -> dict[int, ipp.AsyncResult]:
        return self.wait(
            ar, targets, stream=True, timeout=self.options.start_timeout, watch_hangs=False
        )
