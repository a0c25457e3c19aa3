"""``Cluster``: a set of persistent ranks (ipyparallel engines) joined in one torch world."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import ipyparallel as ipp
import psutil

from axon_nb.checkpoint import Checkpoint, check_save_target
from axon_nb.cluster import reaper
from axon_nb.cluster.launchers import LAUNCHERS
from axon_nb.cluster.options import ClusterOptions
from axon_nb.cluster.waiting import results, wait_for_ranks
from axon_nb.engine import bootstrap, script, world
from axon_nb.engine.placement import PlacementError, plan_world
from axon_nb.errors import (
    AxonError,
    ClusterBrokenError,
    ClusterStartError,
    NoClusterError,
    RankDiedError,
    RankError,
)
from axon_nb.train.handle import TrainHandle
from axon_nb.train.result import TrainResult
from axon_nb.train.spec import SPEC_FIELDS, check_world, make_spec

RANK_GONE_S = 2.0
"""While starting, a rank process missing this long under its MPI proxy has exited."""


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
    ) -> None:
        self.options = ClusterOptions(
            n=n,
            engines=engines,
            backend=backend,
            gpus=tuple(gpus) if gpus is not None else None,
            timeout=timeout,
            start_timeout=start_timeout,
        )
        self._ipp: ipp.Cluster | None = None
        self._client: ipp.Client | None = None
        self._reaper: Any = None
        self._broken: str | None = None
        self.ranks: list[dict[str, Any]] = []
        """One summary per rank (rank, host, pid, device, backend, ...), in rank order."""
        self.last_run: TrainHandle | None = None
        """The latest ``train()`` call's handle (``%axon_dashboard`` shows its dashboard)."""

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
        cluster = ipp.Cluster(n=opts.n, engines=opts.engines, log_level=logging.WARNING)
        LAUNCHERS[opts.engines](cluster)  # may raise (no mpiexec) before anything starts
        self._ipp = cluster
        try:
            cluster.start_controller_sync()
            cluster.start_engines_sync(opts.n)
            self._reaper = reaper.spawn(os.getpid(), cluster.cluster_file)
            self._client = cluster.connect_client_sync()
            self._wait_for_engines()
            self.ranks = self._join_world()
        except BaseException as e:
            launcher_output = self._launcher_output()
            self.stop()
            if isinstance(e, AxonError | KeyboardInterrupt):
                raise
            raise ClusterStartError(f"{e}{launcher_output}") from e
        self._broken = None
        return self

    def stop(self) -> None:
        """Stop engines and controller. Safe to call twice."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._ipp is not None:
            # mpiexec exits non-zero when its ranks are terminated; that is the expected end.
            self._ipp.log.setLevel(logging.ERROR)
            self._ipp.stop_cluster_sync()
            self._ipp = None
        if self._reaper is not None:
            self._reaper.wait(timeout=10)  # it exits once the cluster file is gone
            self._reaper = None
        self.ranks = []

    def restart(self) -> Cluster:
        """Stop everything and start fresh ranks with the same options."""
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
        targets = self._targets(ranks)
        ar = self._view(targets).apply_async(fn, *args, **kwargs)
        return results(self._wait(ar, targets, stream=stream))

    def execute(
        self, code: str, *, ranks: Sequence[int] | None = None, stream: bool = True
    ) -> dict[int, ipp.AsyncResult]:
        """Run ``code`` in every rank's persistent namespace; returns the finished parts by rank.

        Example::

            cluster.execute("x = rank * 2")
            cluster.run(lambda: x)   # NameError: functions see their own globals, not the cell's
        """
        targets = self._targets(ranks)
        ar = self._view(targets).execute(code, silent=False, block=False)
        return self._wait(ar, targets, stream=stream)

    def run_script(self, path: str, args: Sequence[str] = ()) -> list[int]:
        """Run an unmodified torchrun-style script on every rank (fresh processes, own world).

        Returns each rank's exit code (all 0, else :class:`RankError`). Example::

            cluster.run_script("train.py", ["--epochs", "1"])
        """
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such script: {path!r} (relative to {os.getcwd()})")
        targets = self._targets(None)
        ar = self._view(targets).apply_async(
            script.run_script, os.path.abspath(path), list(args), os.getcwd()
        )
        return results(self._wait(ar, targets, stream=True))

    def train(
        self,
        model: Any = None,
        data: Any = None,
        *,
        strategy: Any = None,
        optimizer: Any = None,
        loss: Callable[..., Any] | None = None,
        steps: int,
        batch_size: int,
        grad_accum: int = 1,
        mixed_precision: str | None = None,
        clip_grad_norm: float | None = None,
        schedule: str = "constant",
        warmup_steps: int = 0,
        seed: int = 0,
        resume: bool = False,
        name: str = "model",
        metrics_interval_s: float = 0.5,
        block: bool = True,
    ) -> TrainResult | TrainHandle:
        """Train ``model`` on every rank with ``strategy`` (default ``DDP()``), all steps there.

        ``batch_size`` is the global batch per optimizer step: each rank takes
        ``batch_size / world_size`` samples of its own data shard, in ``grad_accum``
        micro-batches. The trained model stays on the ranks as ``name`` (a ``%%axon`` cell
        can evaluate it), and ``resume=True`` continues it (model, optimizer, step, data order),
        taking new optimizer settings such as ``optimizer=("adamw", {"lr": 1e-4})``.

        Returns a :class:`TrainResult`, or with ``block=False`` a :class:`TrainHandle` at once.
        Ctrl-C stops every rank at the same step boundary and returns the result so far.
        Example::

            from axon_nb import DDP
            result = cluster.train(
                model=make_model, data=make_dataset, strategy=DDP(comm_hook="bf16"),
                optimizer=("adamw", {"lr": 3e-4}), loss=torch.nn.functional.cross_entropy,
                steps=200, batch_size=32, grad_accum=2, mixed_precision="bf16",
                clip_grad_norm=1.0, seed=0,
            )
            result.losses[-1]
        """
        from axon_nb.strategies import DDP

        # Every keyword above that names a TrainSpec field goes into the spec.
        spec = make_spec(DDP, **{k: v for k, v in locals().items() if k in SPEC_FIELDS})
        targets = self._targets(None)
        check_world(spec, len(targets))
        run = uuid.uuid4().hex[:12]
        ar = self._view(targets).apply_async(_train_on_rank, cloudpickle.dumps(spec), run)
        handle = TrainHandle(self, ar, targets, spec, run)
        self.last_run = handle
        if block and _in_notebook():
            handle.show()
        return handle.wait() if block else handle

    def save(
        self,
        path: str | os.PathLike[str],
        kind: str = "full",
        *,
        name: str = "model",
        overwrite: bool = False,
    ) -> Checkpoint:
        """Save training run ``name`` (model, optimizer, step, schedule) as a checkpoint.

        ``kind="full"``: the state is gathered and rank 0 writes one file (``torch.save``);
        ``kind="sharded"``: every rank writes its shards with ``torch.distributed.checkpoint``,
        which can be loaded on a different number of ranks. The checkpoint only appears at
        ``path`` once complete; an existing one is replaced only with ``overwrite=True``, and
        only after the new one is complete. Example::

            cluster.train(model=make_gpt, data=ds, strategy=FSDP(), steps=100)
            cluster.save("ckpt/step100", kind="sharded")
        """
        target = check_save_target(path, kind, overwrite)
        partial = f"{target}.partial-{uuid.uuid4().hex[:12]}"
        targets = self._targets(None)
        ar = self._view(targets).apply_async(
            _checkpoint_on_rank, "save", name, target, partial, kind
        )
        results(self._wait(ar, targets, stream=True))
        return Checkpoint.read(target)

    def load(self, path: str | os.PathLike[str], *, name: str = "model") -> Checkpoint:
        """Load a checkpoint into training run ``name``; ``train(..., resume=True)`` continues.

        The run must exist, built with the checkpoint's model and optimizer (``steps=0`` builds
        one without training); any strategy and number of ranks works for a sharded
        checkpoint. Loading reads tensors only (``weights_only=True``). A checkpoint that does
        not fit the run changes nothing. Example::

            cluster.train(model=make_gpt, data=ds, strategy=FSDP(), steps=0)
            cluster.load("ckpt/step100")
            cluster.train(steps=100, batch_size=32, resume=True)
        """
        ckpt = Checkpoint.read(path)  # missing or incomplete: refused before any rank is asked
        targets = self._targets(None)
        ar = self._view(targets).apply_async(_checkpoint_on_rank, "load", name, ckpt.path)
        results(self._wait(ar, targets, stream=True))
        return ckpt

    def interrupt(self, ranks: Sequence[int] | None = None) -> None:
        """Send SIGINT to the ranks (what Ctrl-C in a running cell does)."""
        _Control(self.client, []).interrupt(self._targets(ranks))

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

    # -- internals -------------------------------------------------------------------------

    def _view(self, targets: list[int]) -> ipp.DirectView:
        """A view on ``targets``; one rank is addressed by its id, so results are not wrapped
        in one-item lists (ipyparallel wraps them for list targets)."""
        return self.client[targets[0] if len(targets) == 1 else targets]

    def _targets(self, ranks: Sequence[int] | None) -> list[int]:
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

    def _wait(
        self,
        ar: ipp.AsyncResult,
        targets: list[int],
        *,
        stream: bool,
        timeout: float | None = None,
        **options: Any,
    ) -> dict[int, ipp.AsyncResult]:
        control = _Control(self.client, list(range(len(self.ranks))) or targets)
        try:
            return wait_for_ranks(
                ar, targets, control=control, stream=stream, timeout=timeout, **options
            )
        except RankDiedError as e:
            self._broken = f"rank {e.rank} died"
            raise
        finally:
            if control.released and not self._broken and self.ranks:
                self._reform_world()

    def _reform_world(self) -> None:
        """Every rank leaves the severed process group and joins a fresh one."""
        print(
            "Ranks had stopped in different collectives, so the process group was re-formed. "
            "Objects built on the old group (DDP models, device meshes) must be rebuilt.",
            file=sys.stderr,
        )
        port = self.client[0].apply_sync(bootstrap.free_port)
        targets = list(range(len(self.ranks)))
        ar = self._view(targets).apply_async(world.reform, port)
        parts = wait_for_ranks(
            ar, targets, control=_Control(self.client, []), timeout=self.options.start_timeout
        )
        self.ranks = results(parts)

    def _wait_for_engines(self) -> None:
        """Wait for all engines to connect, failing fast when a local rank process has exited."""
        n, timeout = self.options.n, self.options.start_timeout
        started = time.monotonic()
        short_since: float | None = None
        while len(self.client.ids) < n:
            now = time.monotonic()
            alive = self._local_rank_processes()
            short_since = (short_since or now) if alive is not None and alive < n else None
            # Spawning takes milliseconds; a rank missing for a while has exited.
            if self._launchers_stopped() or (short_since and now - short_since > RANK_GONE_S):
                raise ClusterStartError(
                    f"a rank exited while starting ({len(self.client.ids)} of {n} engines "
                    f"connected){self._launcher_output()}"
                )
            if now - started > timeout:
                raise ClusterStartError(
                    f"only {len(self.client.ids)} of {n} engines connected within "
                    f"{timeout:.0f} s{self._launcher_output()}"
                )
            time.sleep(0.2)

    def _launchers_stopped(self) -> bool:
        assert self._ipp is not None
        return any(launcher.state == "after" for launcher in self._ipp.engines.values())

    def _local_rank_processes(self) -> int | None:
        """Rank processes alive under this host's MPI proxies; None where they are not visible."""
        assert self._ipp is not None
        if self.options.engines != "mpi":
            return None
        count, seen_proxy = 0, False
        for launcher in self._ipp.engines.values():
            try:
                for child in psutil.Process(launcher.pid).children():
                    if child.name().startswith("hydra_pmi_proxy"):
                        seen_proxy = True
                        count += sum(c.status() != psutil.STATUS_ZOMBIE for c in child.children())
            except psutil.Error:
                continue
        return count if seen_proxy else None

    def _join_world(self) -> list[dict[str, Any]]:
        spec = bootstrap.BootstrapSpec(
            backend=self.options.backend, gpus=self.options.gpus, timeout_s=self.options.timeout
        )
        targets = sorted(self.client.ids)
        try:
            if self.options.engines == "mpi":
                ar = self._view(targets).apply_async(bootstrap.bootstrap_mpi, spec)
                summaries = results(self._wait_start(ar, targets))
            else:
                summaries = self._join_world_from_kernel(spec, targets)
        except RankError as e:
            if e.ename == "PlacementError":
                raise ClusterStartError(e.evalue) from None
            raise ClusterStartError(f"rank {e.rank} failed to start: {e}\n{e.traceback}") from None
        mismatched = [
            (t, s["rank"]) for t, s in zip(targets, summaries, strict=True) if t != s["rank"]
        ]
        if mismatched:
            raise ClusterStartError(f"engine ids and ranks differ: {mismatched}")
        return summaries

    def _join_world_from_kernel(
        self, spec: bootstrap.BootstrapSpec, targets: list[int]
    ) -> list[dict[str, Any]]:
        """Engines without MPI: all on this host; the kernel plans, each rank joins."""
        n = len(targets)
        probes = results(
            self._wait_start(self._view(targets).apply_async(_probe_by_engine_id, n), targets)
        )
        try:
            plans = plan_world(probes, backend=spec.backend, gpus=spec.gpus)
        except PlacementError as e:
            raise ClusterStartError(str(e)) from None
        ars = [
            self.client[t].apply_async(bootstrap.join_world, plans[t], spec.timeout_s)
            for t in targets
        ]
        merged = ipp.AsyncResult(self.client, [m for a in ars for m in a.msg_ids], targets=targets)
        return results(self._wait_start(merged, targets))

    def _wait_start(self, ar: ipp.AsyncResult, targets: list[int]) -> dict[int, ipp.AsyncResult]:
        return self._wait(ar, targets, stream=True, timeout=self.options.start_timeout)

    def _launcher_output(self) -> str:
        """The tail of what the engine launcher (mpiexec) printed, to explain a failed start."""
        if self._ipp is None:
            return ""
        tails = []
        for launcher in self._ipp.engines.values():
            try:
                text = launcher.get_output()
            except Exception:
                continue
            lines = [ln for ln in text.splitlines() if "[IPEngine" not in ln][-15:]
            if lines:
                tails.append("\n".join(lines))
        return ("\nengine launcher output:\n" + "\n".join(tails)) if tails else ""


def _probe_by_engine_id(world_size: int) -> Any:
    """Probe for engines without MPI: rank is the engine id, every rank on this host."""
    from axon_nb.engine.bootstrap import probe

    rank = _engine_id()
    return probe(rank, rank, world_size)


def _in_notebook() -> bool:
    """True in a Jupyter kernel, where widgets render (not in a terminal or a test)."""
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _train_on_rank(spec_bytes: bytes, run: str) -> Any:
    from axon_nb.engine.loop import train_on_rank  # imports torch: on the rank only

    return train_on_rank(spec_bytes, run)


def _checkpoint_on_rank(verb: str, *args: Any) -> Any:
    from axon_nb.engine import checkpoint  # imports torch: on the rank only

    return getattr(checkpoint, verb)(*args)


def _engine_id() -> int:
    from IPython import get_ipython

    shell = get_ipython()
    return int(shell.kernel.engine_id)  # ipyparallel engines expose their id on the kernel


class _Control:
    """Signals and releases ranks on behalf of the waiting loop."""

    def __init__(self, client: ipp.Client, world_ranks: list[int]) -> None:
        self.client = client
        self.world_ranks = world_ranks
        self.released = False

    def interrupt(self, ranks: list[int]) -> None:
        if not ranks:
            return
        try:  # through the engines' nannies, so it works for any launcher and host
            self.client.send_signal(signal.SIGINT, targets=ranks, block=True)
        except Exception as e:  # a dead engine cannot be signalled; the waiting loop says so
            print(f"could not signal ranks {ranks}: {e}", file=sys.stderr)

    def release(self, stuck: list[int]) -> None:
        free = [r for r in self.world_ranks if r not in stuck]
        if not free or not stuck:
            return
        self.released = True
        try:
            self.client[free].apply_async(world.sever).get(timeout=10)
        except Exception as e:
            print(f"could not release ranks {stuck}: {e}", file=sys.stderr)
