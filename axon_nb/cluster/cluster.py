"""``Cluster``: a set of persistent ranks (ipyparallel engines) joined in one torch world."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pathlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp

from axon_nb import ipykernel_sigint
from axon_nb.cluster import (
    attaching,
    features,
    mpi_leftovers,
    reaper,
    startup,
    stopping,
    warm_engines,
)  # fmt: skip
from axon_nb.cluster.control import held_interrupts
from axon_nb.cluster.dask_on_ranks import DaskOnRanks
from axon_nb.cluster.delegates import FeatureDelegates
from axon_nb.cluster.detaching import Detached, open_detached
from axon_nb.cluster.exposure import describe_exposure
from axon_nb.cluster.hangs import WatchDir
from axon_nb.cluster.host_fit import check_fits_here
from axon_nb.cluster.lab_registry import LabRegistry
from axon_nb.cluster.launchers import CONTROLLER_ARGS, LAUNCHERS, configure_controller
from axon_nb.cluster.logs import ClusterLog
from axon_nb.cluster.options import ClusterOptions
from axon_nb.errors import AxonError
from axon_nb.spec.make import make_spec
from axon_nb.spec.train_spec import spec_options
from axon_nb.strategies import DDP

if TYPE_CHECKING:
    import distributed

    from axon_nb.cluster.bandwidth import BandwidthReport
    from axon_nb.train import TrainHandle, TrainResult
    from axon_nb.train.compare import Comparison


class Cluster(FeatureDelegates):  # (a ClusterLike: Transport, and what features use of it)
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
        detach: bool = False,
        name: str | None = None,
        idle_timeout: float = 7200.0,
        preempt_signal: str = "USR2",
    ) -> None:
        arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__(ClusterOptions.from_arguments(**arguments))
        self._ipp: ipp.Cluster | None = None
        self._reaper: Any = None
        self._dask = DaskOnRanks()
        self._dask_rows: list[Any] = []
        self.bandwidth_results: BandwidthReport | None = None
        """The latest :meth:`bandwidth` figures."""
        self.last_run: TrainHandle | None = None
        """The latest ``train()`` call's handle (``%axon_dashboard`` shows its dashboard)."""
        self._registry: LabRegistry | None = None
        """This cluster's entry in JupyterLab's Axon sidebar (in a Jupyter kernel)."""

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start the controller and engines, and join every rank to the torch world.

        On any failure everything started so far is stopped before the error is raised.
        """
        if self._ipp is not None:
            raise AxonError("the cluster is already running; stop() or restart() it first")
        opts = self.options
        check_fits_here(opts)  # refused before anything is launched
        if _in_jupyter_kernel():  # a Ctrl-C as a cell ends must not leave the cell busy
            ipykernel_sigint.install()
        startup.retrying_port_races(lambda: self._launch(opts))
        self._broken = None
        self._dead = set()
        # Before ipyparallel's own exit hook (registered earlier, so run later): a stop that
        # ends busy ranks too (see stop_waits). A killed kernel is the reaper's. A detached
        # cluster is let go instead (its keeper ends it).
        atexit.register(self._at_exit)
        self._registry = LabRegistry.for_kernel(self)
        if self._registry is not None:
            self._registry.start()
        return self

    def _launch(self, opts: ClusterOptions) -> None:
        """One try at starting the controller, the engines and the world; on any failure
        everything started is stopped, and :class:`startup.PortRace` says to try again."""
        self.log = ClusterLog.create()
        cluster = ipp.Cluster(
            n=opts.n,
            engines=opts.engines,
            log=self.log.logger,
            controller_args=CONTROLLER_ARGS,
            shutdown_atexit=not opts.detach,
        )
        # may raise (no mpiexec) before anything starts
        LAUNCHERS[opts.engines](cluster, opts, str(self.log.path))
        if opts.engines == "mpi":
            mpi_leftovers.remove_stale()  # what SIGKILLed MPI jobs left in /dev/shm
        self._ipp = cluster
        try:
            self._watch = WatchDir.create()
            configure_controller(cluster, self._watch.path)
            cluster.start_controller_sync()  # a port lost meanwhile: PortRace, below
            cluster.start_engines_sync(opts.n)
            launched = stopping.launcher_pids(cluster)
            guardian = os.getpid()  # (what the reaper watches: the kernel, or the keeper)
            if opts.detach:
                self.detached = Detached.claim(opts.name)
                self.options = opts = dataclasses.replace(opts, name=self.detached.name)
                guardian = self.detached.start_keeper(opts.n, cluster.cluster_file,
                                                      str(self._watch.path), launched,
                                                      opts.idle_timeout)  # fmt: skip
            self._reaper = reaper.spawn(
                guardian, cluster.cluster_file, str(self._watch.path), launched
            )
            # (ipyparallel's 10 s for the controller's first answer is too short on a busy host)
            self._client = startup.connect_client(cluster, opts.start_timeout)
            startup.wait_for_engines(cluster, self._client, opts, self.log)
            self.ranks = startup.join_world(self._client, opts, self._wait_start,
                                            str(self._watch.path),
                                            kernel_addr=cluster.controller_ip or None)  # fmt: skip
            if self.detached is not None:
                self.detached.finish_start(self, cluster.cluster_file, str(self._watch.path),
                                           launched)  # fmt: skip
        except BaseException as e:
            lost_a_port = startup.port_was_taken(cluster, self.log)
            self.stop()  # copies what the controller wrote by now (more than above, on a busy host)
            lost_a_port = lost_a_port or startup.port_taken_in_log(self.log)
            error = startup.start_error(e, lost_a_port, self.log)
            if error is e:
                raise
            raise error from e

    def stop(self, *, keep_warm: bool = False) -> None:
        """Stop engines, controller and the warm process for engines (``keep_warm``: not it).
        Safe to call twice; a Ctrl-C meanwhile is held until everything is stopped."""
        with held_interrupts() as held:
            self._stop()
            if not keep_warm:
                warm_engines.stop_if_idle()
        if held.arrived:
            print("(Ctrl-C was held until the cluster had stopped)", file=sys.stderr)

    def _at_exit(self) -> None:
        if self.detached is not None:
            self.detached.let_go()
        else:
            self.stop()

    def _runs_elsewhere(self) -> bool:
        """True while another kernel's run trains on this (detached) cluster's ranks: they
        would act on a shutdown request only once it ends."""
        with contextlib.suppress(OSError):
            return self.detached is not None and self.detached.busy_run() is not None
        return False

    def _stop(self) -> None:
        atexit.unregister(self._at_exit)
        if self._registry is not None:
            self._registry.close()
            self._registry = None
        self._dask_rows = []
        self._dask.forget()
        if self._ipp is not None:
            if self.log is not None:
                startup.copy_launcher_output(self._ipp, self.log)
            with mpi_leftovers.removed_after(self.ranks, self.options.engines):
                stopping.end_cluster(
                    self._ipp, self._client, ask=not self._broken, busy=self._runs_elsewhere()
                )
            self._ipp = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._reaper is not None:
            reaper.dismiss(self._reaper)
            self._reaper = None
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        if self.log is not None:
            self.log.close()
        if self.detached is not None:
            self.detached.end()
            self.detached = None
        self.ranks = []

    @classmethod
    def attach(cls, name: str) -> Cluster:
        """The running detached cluster ``name`` of this user (``axon_nb.attach``)."""
        detached, record = open_detached(name)
        detached.hold_lease()  # (first: the keeper cannot end it as idle meanwhile)
        opts = record["options"]
        cluster = cls(**{**opts, "gpus": opts["gpus"] and tuple(opts["gpus"])}, detach=True,
                      name=name)  # fmt: skip
        try:
            cluster._ipp, cluster._client = attaching.connect(record, opts["start_timeout"])
        except BaseException:
            detached.let_go()
            raise
        cluster.ranks, cluster.detached = record["ranks"], detached
        cluster._watch = WatchDir(pathlib.Path(record["watch_dir"]))
        atexit.register(cluster._at_exit)
        return cluster

    @property
    def name(self) -> str | None:
        """A detached cluster's name (``%axon_attach NAME``); None for one that is not."""
        return self.options.name

    def restart(self, n: int | None = None) -> Cluster:
        """Stop everything and start fresh ranks with the same options (``n`` ranks if given).
        Example::

            cluster.restart(n=2)   # go on with 2 ranks
        """
        if n is not None:
            self.options = dataclasses.replace(self.options, n=n)  # checked before stopping
        self.stop(keep_warm=True)
        return warm_engines.ended_on_failure(self.start)

    def __enter__(self) -> Cluster:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        if self._broken:
            state = "broken"
        return f"<axon_nb.Cluster n={self.options.n} engines={self.options.engines} {state}>"

    # -- features: each a function in its own module over this cluster ---------------------
    # The options are declared once, on TrainSpec (axon_nb/spec/train_spec.py); train and
    # compare take them by name (tests/test_signatures.py checks each, with its default),
    # build the spec once and pass it down.

    def train(
        self, model: Any = None, data: Any = None, *, strategy: Any = None,
        columns: tuple[Any, Any] | None = None, optimizer: Any = None,
        param_groups: Callable[[str, Any], Mapping[str, Any] | None] | None = None,
        no_decay: str | None = None, loss: Callable[..., Any] | None = None,
        loss_normalization: str = "mean", steps: int, batch_size: int, grad_accum: int = 1,
        mixed_precision: str | None = None, clip_grad_norm: float | None = None,
        loader: dict[str, Any] | None = None, compile: bool = False, schedule: str = "constant",
        warmup_steps: int = 0, scheduler: Callable[..., Any] | None = None, seed: int = 0,
        resume: bool = False, name: str = "model", metrics_interval_s: float = 0.5,
        checkpoint_dir: str | os.PathLike[str] | None = None, checkpoint_every: int | None = None,
        checkpoint_every_s: float | None = None, keep: int | None = None, max_restarts: int = 0,
        min_ranks: int | None = None, eval_data: Any = None, eval_every: int | None = None,
        metrics: Mapping[str, Callable[..., Any]] | None = None,
        log_to: str | Sequence[str] | None = None, log_dir: str | os.PathLike[str] | None = None,
        trace: tuple[int, int] | None = None, block: bool = True,
    ) -> TrainResult | TrainHandle:  # fmt: skip
        """Train ``model`` on every rank with ``strategy`` (default ``DDP()``); ``batch_size`` is
        the global batch per optimizer step. Each option is a field of
        :class:`~axon_nb.spec.train_spec.TrainSpec`, documented there; what a run does with them
        (checkpoints, restarts, dask data, trackers) is in :mod:`axon_nb.train.on_cluster`.
        Returns a :class:`TrainResult`, or with ``block=False`` a :class:`TrainHandle` at once.
        Example::

            result = cluster.train(make_model, ds, strategy=DDP(), steps=100, batch_size=32)
        """
        spec = make_spec(DDP, **spec_options(locals()))
        return features.train(self, spec, block=block)

    def compare(
        self, strategies: list[Any], *, steps: int = 10, warmup: int = 2, model: Any = None,
        data: Any = None, columns: tuple[Any, Any] | None = None, optimizer: Any = None,
        param_groups: Callable[[str, Any], Mapping[str, Any] | None] | None = None,
        no_decay: str | None = None, loss: Callable[..., Any] | None = None,
        loss_normalization: str = "mean", batch_size: int, grad_accum: int = 1,
        mixed_precision: str | None = None, clip_grad_norm: float | None = None,
        loader: dict[str, Any] | None = None, compile: bool = False, schedule: str = "constant",
        warmup_steps: int = 0, scheduler: Callable[..., Any] | None = None, seed: int = 0,
        metrics_interval_s: float = 0.5, from_state: bool | str = False,
    ) -> Comparison:  # fmt: skip
        """Each strategy trained ``steps`` steps on these ranks from the same model, data and
        seed, side by side with its prediction (:func:`axon_nb.train.compare.compare`); the
        other options are :meth:`train`'s. Example::

            cluster.compare([DDP(), FSDP()], model=make_model, data=ds, batch_size=32)
        """
        spec = make_spec(DDP, **spec_options(locals()), resume=bool(from_state))  # (DDP: replaced)
        return features.compare(self, strategies, spec, warmup=warmup, from_state=from_state)

    def dask(self, *, dashboard: bool = False) -> distributed.Client:
        """A ``distributed.Client`` whose workers are the ranks (one per rank, in its engine),
        its scheduler in the controller, over TLS with the cluster's own certificates;
        ``dashboard=True`` serves dask's dashboard on loopback. Made on first use and after a
        restart, stopped with the cluster; prints where it listens. Example::

            client = cluster.dask()
            df = dd.read_parquet("data/*.parquet").persist()   # read by the ranks
        """
        return self._dask.ensure(self, self._watch, self._ipp, dashboard=dashboard)

    def hold_dask_rows(self, futures: list[Any]) -> None:
        """Keep the dask futures of the latest run's rows alive (the previous run's go)."""
        self._dask_rows = list(futures)

    def exposure(self) -> str:
        """One line: what the cluster's processes listen on, beyond this kernel. Example::

        cluster.exposure()   # 'Listening on loopback only: ...'
        """
        controller = self._ipp.controller_ip if self._ipp is not None else None
        return describe_exposure(self.options, self.ranks, controller, self._dask.client)


def _in_jupyter_kernel() -> bool:
    if "ipykernel" not in sys.modules:
        return False
    from ipykernel.kernelapp import IPKernelApp

    return IPKernelApp.initialized()
