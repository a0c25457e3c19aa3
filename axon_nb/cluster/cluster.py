"""``Cluster``: a set of persistent ranks (ipyparallel engines) joined in one torch world."""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp

from axon_nb import ipykernel_sigint
from axon_nb.cluster import features, mpi_leftovers, reaper, startup, stopping, warm_engines
from axon_nb.cluster.control import held_interrupts
from axon_nb.cluster.dask_on_ranks import DaskOnRanks
from axon_nb.cluster.exposure import describe_exposure
from axon_nb.cluster.hangs import WatchDir
from axon_nb.cluster.host_fit import check_fits_here
from axon_nb.cluster.lab_registry import LabRegistry
from axon_nb.cluster.launchers import CONTROLLER_ARGS, LAUNCHERS, configure_controller
from axon_nb.cluster.logs import ClusterLog
from axon_nb.cluster.options import ClusterOptions
from axon_nb.cluster.transport import ClusterLike
from axon_nb.errors import AxonError
from axon_nb.rank import entry
from axon_nb.spec.make import make_spec
from axon_nb.spec.train_spec import spec_options
from axon_nb.strategies import DDP

if TYPE_CHECKING:
    from pathlib import Path

    import distributed

    from axon_nb.cluster.bandwidth import BandwidthReport
    from axon_nb.estimate.advisor import Advice
    from axon_nb.spec.checkpoint_format import Checkpoint
    from axon_nb.train import TrainHandle, TrainResult
    from axon_nb.train.compare import Comparison


class Cluster(ClusterLike):  # (ClusterLike: Transport, and what features use of a Cluster)
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
        # ends busy ranks too (see stop_waits). A killed kernel is the reaper's.
        atexit.register(self.stop)
        self._registry = LabRegistry.for_kernel(self)
        if self._registry is not None:
            self._registry.start()
        return self

    def _launch(self, opts: ClusterOptions) -> None:
        """One try at starting the controller, the engines and the world; on any failure
        everything started is stopped, and :class:`startup.PortRace` says to try again."""
        self.log = ClusterLog.create()
        cluster = ipp.Cluster(
            n=opts.n, engines=opts.engines, log=self.log.logger, controller_args=CONTROLLER_ARGS
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
            self._reaper = reaper.spawn(
                os.getpid(), cluster.cluster_file, str(self._watch.path), launched
            )
            # (ipyparallel's 10 s for the controller's first answer is too short on a busy host)
            self._client = startup.connect_client(cluster, opts.start_timeout)
            startup.wait_for_engines(cluster, self._client, opts, self.log)
            self.ranks = startup.join_world(self._client, opts, self._wait_start,
                                            str(self._watch.path),
                                            kernel_addr=cluster.controller_ip or None)  # fmt: skip
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

    def _stop(self) -> None:
        atexit.unregister(self.stop)
        if self._registry is not None:
            self._registry.close()
            self._registry = None
        self._dask_rows = []
        self._dask.forget()
        if self._ipp is not None:
            if self.log is not None:
                startup.copy_launcher_output(self._ipp, self.log)
            with mpi_leftovers.removed_after(self.ranks, self.options.engines):
                stopping.end_cluster(self._ipp, self._client, ask=not self._broken)
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
        self.ranks = []

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

    def profile(self, model: Any, data: Any, loss: Any = None, *, samples: int = 4) -> Any:
        """Measure ``model`` on rank 0 (one forward and backward of ``samples`` items of
        ``data``): the :class:`~axon_nb.estimate.ModelProfile` that ``predict`` and ``advise``
        work from. Example::

            profile = cluster.profile(model=make_gpt, data=ds, loss=lm_loss)
        """
        from axon_nb.estimate import ModelProfile

        [measured] = self.run(entry.profile_model, model, data, loss, samples, ranks=[0],
                              stream=False)  # fmt: skip
        return ModelProfile.from_dict(measured)

    def advise(
        self, model: Any, data: Any = None, loss: Any = None, *, device_memory: str | float,
        batch_size: int | None = None, strategies: list[Any] | None = None,
        bandwidth: Any = None, device_flops: float | None = None, optimizer: Any = None,
        mixed_precision: str | None = None,
    ) -> Advice:  # fmt: skip
        """:func:`axon_nb.advise` for this world and its hosts, the model profiled on rank 0
        and the links from :meth:`bandwidth` when it has run. Example::

            cluster.advise(make_gpt, ds, lm_loss, device_memory="80GB", batch_size=64)
        """
        from axon_nb.estimate import advise

        world = len(self.targets())
        return advise(
            profile=self.profile(model, data, loss), world_size=world,
            hosts=max(1, world // self.ranks_per_host), device_memory=device_memory,
            batch_size=batch_size, strategies=strategies, device_flops=device_flops,
            bandwidth=self.bandwidth_results if bandwidth is None else bandwidth,
            optimizer=optimizer, mixed_precision=mixed_precision,
        )  # fmt: skip

    def bandwidth(
        self, collectives: Sequence[str] | str | None = None,
        sizes: str | Sequence[int] = "1K:16M", *, iters: int = 10, warmup: int = 3,
    ) -> BandwidthReport:  # fmt: skip
        """Collective bandwidth and latency on these ranks as nccl-tests measures them
        (:func:`axon_nb.cluster.bandwidth.bandwidth`). Example::

            cluster.bandwidth("all_reduce", sizes="1M:64M")   # a table and a plot
        """
        return features.bandwidth(**_forward(locals()))

    def evaluate(
        self, data: Any, *, loss: Callable[..., Any] | None = None,
        metrics: Mapping[str, Callable[..., Any]] | None = None, batch_size: int,
        name: str = "model",
    ) -> dict[str, float]:  # fmt: skip
        """Loss and metrics of the model the ranks hold over ``data``, every sample once, under
        its own strategy: :func:`axon_nb.train.evaluate.evaluate`. Example::

        cluster.evaluate(test_ds, loss=mse, metrics={"mae": mae}, batch_size=64)
        """
        return features.evaluate(**_forward(locals()))

    def predict(
        self, data: Any, *, batch_size: int, name: str = "model",
        output_dir: str | os.PathLike[str] | None = None,
    ) -> Any:  # fmt: skip
        """The held model's outputs for every item of ``data``, in data order, as CPU tensors:
        :func:`axon_nb.train.predict.predict`. Example::

        logits = cluster.predict(test_ds, batch_size=64)
        """
        return features.predict(**_forward(locals()))

    def generate(
        self, input_ids: Any, *, max_new_tokens: int, attention_mask: Any = None,
        seed: int | None = None, name: str = "model", **generate_kwargs: Any,
    ) -> Any:  # fmt: skip
        """Continue prompts with the held transformers causal LM (DDP, FSDP, tensor parallel):
        :func:`axon_nb.train.generate.generate`. Example::

        cluster.generate(ids, max_new_tokens=20, do_sample=True, top_k=50, seed=0)
        """
        return features.generate(**_forward(locals()))

    def save(
        self, path: str | os.PathLike[str], kind: str = "full", *, name: str = "model",
        overwrite: bool = False, private: bool = True, format: str = "torch",
    ) -> Checkpoint | Path:  # fmt: skip
        """Save a run (:func:`axon_nb.checkpoint.save`); ``format="hf"``: its model for
        ``from_pretrained``. Example::

        cluster.save("ckpt/step100", kind="sharded")
        cluster.save("out/llama", format="hf")
        """
        return features.save(**_forward(locals()))

    def load(self, path: str | os.PathLike[str], *, name: str = "model") -> Checkpoint:
        """Load a checkpoint into run ``name`` (:func:`axon_nb.checkpoint.load`). Example::

        cluster.load("ckpt/step100")
        """
        return features.load(**_forward(locals()))

    def rescue(
        self, path: str | os.PathLike[str], *, name: str = "model", private: bool = True
    ) -> Checkpoint:
        """Save what the surviving ranks hold after a rank died
        (``axon_nb.checkpoint.on_cluster.rescue``). Example::

            cluster.rescue("ckpt/rescued")
        """
        return features.rescue(**_forward(locals()))

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


def _forward(arguments: dict[str, Any]) -> dict[str, Any]:
    """A delegate's own arguments (its ``locals()``), for the function it delegates to, with
    the cluster as ``cluster``."""
    arguments = {k: v for k, v in arguments.items() if k != "__class__"}
    return {"cluster": arguments.pop("self"), **arguments}


def _in_jupyter_kernel() -> bool:
    if "ipykernel" not in sys.modules:
        return False
    from ipykernel.kernelapp import IPKernelApp

    return IPKernelApp.initialized()
