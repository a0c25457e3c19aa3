"""``Transport``: the live connection to a cluster's ranks, apart from starting and stopping
them (``Cluster``): sending work and waiting for it, the world's state (dead ranks, a broken
or re-formed world) and seeing into busy ranks.

One path to the ranks: every feature sends its work with :meth:`Transport.send` (or
:meth:`Transport.run`, send and wait) and waits with :meth:`Sent.wait`; the control channel
(re-forming the world, rescuing a broken one) with :meth:`Transport.control_call`. Both leave
through ``sending.dispatch``, the one place that hands ipyparallel a message.

Features (``train``, ``checkpoint``, ``compare``, ``bandwidth``, ``dask``, recovery) take a
cluster and use only what is here and in :class:`ClusterLike`, so none of them imports
``Cluster`` and ``Cluster`` can import them all.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp

from axon_nb.cluster import hangs
from axon_nb.cluster.control import Control, held_interrupts
from axon_nb.cluster.hangs import ANSWER_S, HangWatch, WatchDir
from axon_nb.cluster.options import ClusterOptions
from axon_nb.cluster.sending import call_args, dispatch, dispatch_code
from axon_nb.cluster.stacks import StackReport
from axon_nb.cluster.stopping import alive
from axon_nb.cluster.waiting import release_left_behind, results, wait_for_ranks
from axon_nb.errors import ClusterBrokenError, NoClusterError, RankDiedError, RankError
from axon_nb.rank import entry
from axon_nb.spec.signals import NATIVE_SIGNAL

if TYPE_CHECKING:
    import distributed

    from axon_nb.cluster.detaching import Detached
    from axon_nb.cluster.logs import ClusterLog


class Transport:
    """The ranks of a started cluster as something to send work to (see the module doc)."""

    def __init__(self, options: ClusterOptions) -> None:
        self.options = options
        self._client: ipp.Client | None = None
        self._watch: WatchDir | None = None
        self._broken: str | None = None
        self._dead: set[int] = set()
        self.ranks: list[dict[str, Any]] = []
        """One summary per rank (rank, host, pid, device, backend, ...), in rank order."""
        self.log: ClusterLog | None = None
        """The log file of the latest start: controller, MPI launcher and engine output."""
        self.detached: Detached | None = None
        """A detached cluster's directory and keeper (``cluster/detaching.py``)."""

    @property
    def running(self) -> bool:
        """True once the world is joined and until the cluster stops."""
        return self._client is not None and bool(self.ranks)

    @property
    def broken(self) -> str | None:
        """Why the world is broken (``"rank 1 died (its output: ...)"``); None while whole."""
        return self._broken

    @property
    def client(self) -> ipp.Client:
        """The ipyparallel client connected to the ranks (engine id == rank)."""
        if self._client is None:
            raise NoClusterError(
                "the cluster is not running: call cluster.start() or use `%axon_cluster N`"
            )
        return self._client

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
        return self.send(fn, *args, ranks=ranks, **kwargs).wait(stream=stream)

    def send(
        self, fn: Callable[..., Any], *args: Any, ranks: Sequence[int] | None = None, **kwargs: Any
    ) -> Sent:
        """Send ``fn(*args, **kwargs)`` to every rank (or ``ranks``) without waiting; wait with
        :meth:`Sent.wait`. The function and its arguments are pickled once (cloudpickle:
        functions and classes defined in the notebook travel by value) and sent as one
        message whatever the number of ranks. A Ctrl-C while sending is held back and
        delivered by the wait. Example::

            sent = cluster.send(entry.evaluate, name, data, loss, {}, 32)
            sent.wait()   # [{"loss": 0.31, ...}, ...] in rank order
        """
        targets = self.targets(ranks)
        if self.detached is not None:  # (another kernel's run may be training on them)
            self.detached.refuse_if_busy()
        with held_interrupts() as held:
            ar = dispatch(self.client, targets, *call_args(fn, args, kwargs))
        return Sent(self, ar, targets, held.arrived)

    def control_call(
        self, fn: Callable[..., Any], *args: Any, ranks: list[int], timeout: float | None = None
    ) -> list[Any]:
        """The control channel: ``fn(*args)`` (a function of ``axon_nb.rank.entry``) on
        ``ranks`` and wait, also while the world is broken or being re-formed (rescue, the
        re-forming itself): no check of the world, no hang watch, nothing re-formed after.
        Results in ``ranks`` order. Example::

            cluster.control_call(entry.rescue_pieces, name, partial, ranks=alive)
        """
        ar = dispatch(self.client, ranks, fn, *args)
        control = Control(self.client, ranks)
        return results(
            wait_for_ranks(ar, ranks, control=control, timeout=timeout or self.options.timeout)
        )

    def execute(
        self, code: str, *, ranks: Sequence[int] | None = None, stream: bool = True
    ) -> dict[int, ipp.AsyncResult]:
        """Run ``code`` in every rank's persistent namespace; returns the finished parts by rank.

        Example::

            cluster.execute("x = rank * 2")
            cluster.run(lambda: x)   # NameError: functions see their own globals, not the cell's
        """
        targets = self.targets(ranks)
        if self.detached is not None:
            self.detached.refuse_if_busy()
        with held_interrupts() as held:
            ar = dispatch_code(self.client, targets, code)
        return Sent(self, ar, targets, held.arrived).parts(stream=stream)

    def run_script(self, path: str, args: Sequence[str] = ()) -> list[int]:
        """Run an unmodified torchrun-style script on every rank (fresh processes, own world).

        Returns each rank's exit code (all 0, else :class:`RankError`). Example::

            cluster.run_script("train.py", ["--epochs", "1"])
        """
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such script: {path!r} (relative to {os.getcwd()})")
        return self.run(entry.run_script, os.path.abspath(path), list(args), os.getcwd())

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
            or (r.get("host") == here and not alive(r["pid"]))  # (a zombie has ended)
        ]
        return [r["rank"] for r in self.ranks if r["rank"] not in dead], dead

    def _check_alive(self) -> None:
        """Raise :class:`RankDiedError` for a rank that died since the last call (killed
        while idle: the OOM killer, a `kill`), marking the world broken as a death seen during
        a call does, instead of ipyparallel's ``KeyError`` for an engine it dropped."""
        _, dead = self.survivors()
        if not dead:
            return
        self._dead.update(dead)
        error = RankDiedError(dead[0], "EngineError", "its process is gone", "", dead)
        error.when = "between calls"
        raise self._broken_by(error)

    def _broken_by(self, error: RankDiedError) -> RankDiedError:
        """Mark the world broken by ``error``'s rank; ``error``, ending with the log's end."""
        self._dead.add(error.rank)
        where = f" (its output: {self.log.path})" if self.log is not None else ""
        self._broken = f"rank {error.rank} died{where}"
        return error.with_log(self.log.ending() if self.log is not None else "")

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
        self._check_alive()
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

            def report(seconds: float) -> None:
                self.report_hang(seconds, progress="no rank finished or printed")

            hang = HangWatch(self.options.hang_timeout, report)
        try:
            return wait_for_ranks(
                ar, targets, control=control, stream=stream, timeout=timeout, hang=hang, **options
            )
        except RankDiedError as e:
            self._broken_by(e)
            raise
        except RankError:
            # Ranks that failed apart may have issued different collectives (one raised, or
            # was interrupted, before one its peers issued): compare, re-form if they differ.
            if joined and ar.ready():
                with held_interrupts():
                    control.check_in_step()
            raise
        except KeyboardInterrupt:
            # However quickly Ctrl-C came twice, no rank is left inside a collective its
            # peers left: the next call's collective would pair with it and abort the rank.
            if joined:
                with held_interrupts():
                    release_left_behind(ar, targets, control)
            raise
        finally:
            if control.released and not self._broken and self.ranks:
                # A Ctrl-C now (the second of a quick pair) would leave the ranks between
                # the old group and the new one, with none: it waits for the re-forming.
                with held_interrupts() as held:
                    self._reform_world()
                if held.arrived and sys.exc_info()[0] is None:
                    raise KeyboardInterrupt

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
        [port] = self.control_call(entry.free_port, ranks=[0])
        targets = list(range(len(self.ranks)))
        self.ranks = self.control_call(
            entry.reform,
            port,
            f"store-reform-{uuid.uuid4().hex[:12]}",
            ranks=targets,
            timeout=self.options.start_timeout,
        )

    def _wait_start(self, ar: ipp.AsyncResult, targets: list[int]) -> dict[int, ipp.AsyncResult]:
        return self.wait(
            ar, targets, stream=True, timeout=self.options.start_timeout, watch_hangs=False
        )


class Sent:
    """Work :meth:`Transport.send` sent to the ranks, to be waited for once (``ar``: its
    ipyparallel ``AsyncResult``, one message per rank of ``targets``)."""

    def __init__(
        self, transport: Transport, ar: ipp.AsyncResult, targets: list[int], interrupted: bool
    ) -> None:
        self.transport = transport
        self.ar = ar
        self.targets = targets
        self.interrupted = interrupted
        """A Ctrl-C came while sending (held back): the wait delivers it first thing."""

    def wait(self, *, stream: bool = True, **options: Any) -> list[Any]:
        """Wait as :meth:`parts` does; the results in rank order. Example::

        cluster.send(noop).wait()   # [None, None]
        """
        return results(self.parts(stream=stream, **options))

    def parts(self, *, stream: bool = True, **options: Any) -> dict[int, ipp.AsyncResult]:
        """Wait for every rank (``Transport.wait``: output streamed, the first failure raised,
        Ctrl-C forwarded, the world's state kept); each rank's finished part. ``options`` as
        ``waiting.wait_for_ranks`` takes them (``tick``, ``timeout``, ``soft_stop_s``,
        ``watch_hangs``). Example::

            parts = cluster.send(fn).parts(tick=redraw)
        """
        interrupted, self.interrupted = self.interrupted, False  # (delivered once)
        return self.transport.wait(
            self.ar, self.targets, stream=stream, interrupted=interrupted, **options
        )


if TYPE_CHECKING:

    class ClusterLike(Transport):
        """What features use of a cluster beyond its :class:`Transport` (``Cluster`` has
        it); for type checkers only, so that no feature imports ``Cluster``."""

        last_run: Any
        # what a resize (cluster/resize.py) changes beyond the ranks: launches and dask
        _ipp: ipp.Cluster | None
        _reaper: Any
        _dask: Any  # (a DaskOnRanks, which imports this module)
        _dask_rows: list[Any]

        def restart(self, n: int | None = None) -> ClusterLike: ...

        def stop(self) -> None: ...

        def profile(self, model: Any, data: Any, loss: Any = None, *, samples: int = 4) -> Any: ...

        def dask(self) -> distributed.Client: ...

        def hold_dask_rows(self, futures: list[Any]) -> None: ...

else:
    ClusterLike = Transport
