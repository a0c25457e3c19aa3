"""``TrainHandle``: a training run in progress on the ranks, seen from the kernel.

The handle puts three parts together: the run's metrics stream and the monitor thread that
reads it (``train/run_stream.py``), the hang watchdog that listens to it
(``train/watchdog.py``), and what the run shows and prints (``train/presenter.py``: the
dashboard, the text bar, the messages at its end). It waits for the ranks' results itself.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp

from axon_nb.cluster.waiting import results
from axon_nb.errors import RankError
from axon_nb.spec.train_spec import TrainSpec
from axon_nb.train.presenter import RunPresenter
from axon_nb.train.result import TrainResult, build_result
from axon_nb.train.run_stream import LAST_PUBLICATION_S, MONITOR_S, MetricsListener, RunStream
from axon_nb.train.training_begun import wait_until_training
from axon_nb.train.watchdog import HangWatchdog
from axon_nb.widgets.dashboard import Dashboard

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike, Sent

SOFT_STOP_S = 120.0
"""After Ctrl-C or ``stop()``, how long ranks get to reach the next step boundary."""


class TrainHandle:
    """A run started with ``cluster.train(..., block=False)``.

    The ranks are busy until it ends: other work sent to them (``%%axon`` cells,
    ``cluster.run``) waits in their queue behind it.

    Example::

        handle = cluster.train(model=make_model, data=ds, steps=1000, block=False)
        handle.history[-1]["loss"]    # what has streamed in so far
        result = handle.stop()        # all ranks stop at the same step; the model stays usable
    """

    def __init__(
        self,
        cluster: ClusterLike,
        sent: Sent,
        spec: TrainSpec,
        run: str,
        *,
        label: str | None = None,
    ) -> None:
        self._cluster = cluster
        self._sent = sent
        """The run on the ranks (``Transport.send``): its wait delivers a Ctrl-C that came
        while it was being sent."""
        ar, targets = sent.ar, sent.targets
        self._ar = ar
        self._targets = targets
        self._spec = spec
        self._result: TrainResult | None = None
        self.restart_on_death = False
        """Set by automatic recovery (``max_restarts``), which restarts every rank when one
        dies: the wait then ends at the death, without bringing the survivors to rest."""
        hosts = len({r.get("host") for r in cluster.ranks})
        where = f" on {hosts} hosts" if hosts > 1 else ""
        self._presenter = RunPresenter(
            spec.name,
            label=label or f"train {spec.name}",
            steps=spec.steps,
            world_size=len(targets),
            title=f"{spec.name} · {spec.strategy.name} · {len(targets)} ranks{where}",
        )
        self._segments: list[TrainResult] = []
        """What the run did before each ``cluster.resize`` moved it to another world."""
        self._resizes: list[dict[str, Any]] = []
        self._listeners: list[MetricsListener] = []
        """The listeners a paused run's stream handed over, for the stream it goes on in."""
        self._stream = RunStream(cluster, ar, targets, run)
        hang_timeout = cluster.options.hang_timeout
        if hang_timeout is not None:  # (first: a hang cleared at the end, then the freeze)
            watchdog = HangWatchdog(
                cluster, hang_timeout, show=self._presenter.show_hang, running=self._running
            )
            self._stream.add_listener(watchdog)
        self._stream.add_listener(self._presenter.dashboard)
        self._stream.start()

    @property
    def name(self) -> str:
        return self._spec.name

    @property
    def done(self) -> bool:
        """True once every rank has finished (or failed)."""
        return self._ar.ready()

    @property
    def dashboard(self) -> Dashboard:
        """The live widget of this run; display it (``%axon_dashboard``) to watch."""
        return self._presenter.dashboard

    @property
    def shown(self) -> bool:
        """True once the dashboard is displayed (then no text bar is drawn)."""
        return self._presenter.shown

    @property
    def history(self) -> list[dict[str, Any]]:
        """Steps streamed so far, in :class:`TrainResult`'s ``history`` format."""
        if self._result is not None:
            return self._result.history
        return [*(h for s in self._segments for h in s.history), *self._stream.history()]

    @property
    def latest(self) -> dict[int, dict[str, Any]]:
        """Each rank's latest publication without its records (status, step, memory, ...)."""
        return self._stream.latest()

    def ran_on(self, client: ipp.Client) -> bool:
        """Whether the run went to ``client``'s ranks (a restart starts new ones)."""
        return self._stream.reads(client)

    def poll(self) -> None:
        """Read what the ranks have published since the last poll."""
        self._stream.poll()

    def add_listener(self, listener: MetricsListener) -> None:
        """Send every new publication, and the run's end, to ``listener`` (a dashboard)."""
        self._stream.add_listener(listener)

    def summaries(self) -> list[dict[str, Any]]:
        """What each rank that finished returned (rank order, once :attr:`done`): its step
        records, memory and totals, which the result is built from."""
        return self._stream.summaries()

    def wait(self, timeout: float | None = None) -> TrainResult:
        """Block until the run ends and return its result (Ctrl-C stops it at a step boundary).

        With ``timeout``, raise ``TimeoutError`` if it is still running then; it keeps running.
        """
        if self._result is None:
            if timeout is not None and not self._ar.wait(timeout):
                raise TimeoutError(
                    f"training {self.name!r} is still running after {timeout:g} s; call wait() "
                    "again, or stop() to end it at the next step"
                )
            parts = self._wait_for_ranks()
            self._result = self._whole(
                build_result(
                    results(parts), name=self._spec.name, strategy=self._spec.strategy.describe()
                )
            )
            self._presenter.report(self._result)
        return self._result

    def _whole(self, last: TrainResult) -> TrainResult:
        """The result of the whole run: ``last`` after what it did before its resizes."""
        if not self._segments:
            return last
        first = self._segments[0]
        history = [h for s in self._segments for h in s.history] + last.history
        return dataclasses.replace(
            last, start_step=first.start_step, history=history, resizes=list(self._resizes)
        )

    # -- cluster.resize moves a run in progress to the new world (cluster/resize.py) ----------

    def _pause(self) -> TrainResult:
        """Stop the run at the next step boundary on every rank and keep what it did (its
        listeners are kept for :meth:`_carry_on`); what it did, ``finished`` if it had."""
        self._listeners = self._stream.hand_over()
        self.request_stop()
        try:
            parts = self._sent.parts(soft_stop_s=SOFT_STOP_S, watch_hangs=False)
        except BaseException:
            self._stream.take_back()
            raise
        self._stream.join(timeout=LAST_PUBLICATION_S + MONITOR_S * 50)
        segment = build_result(
            results(parts), name=self._spec.name, strategy=self._spec.strategy.describe()
        )
        self._segments.append(segment)
        return segment

    def _carry_on(
        self, sent: Sent, spec: TrainSpec, run: str, resize: dict[str, Any] | None
    ) -> None:
        """The paused run goes on as ``sent`` (``spec``; on the resized world, ``resize`` its
        record, or on the same world after a resize failed); its dashboard and listeners
        follow it."""
        self._sent, self._ar, self._targets, self._spec = sent, sent.ar, sent.targets, spec
        self._stream = RunStream(self._cluster, sent.ar, sent.targets, run)
        if resize is not None:
            self._resizes.append(resize)
            for listener in self._listeners:  # (the dashboard, the trackers)
                resized = getattr(listener, "resized", None)
                if resized is not None:
                    resized(resize["from"], resize["to"], resize["step"])
        for listener in self._listeners:
            self._stream.add_listener(listener)
        self._stream.start()

    def _end_paused(self) -> None:
        """The paused run does not go on (it had finished, or the resize failed): its result
        is what it did, and its listeners get its end."""
        self._stream.take_back()
        last = self._segments.pop()
        self._result = self._whole(last)
        self._presenter.report(self._result)

    def _wait_for_ranks(self) -> dict[int, ipp.AsyncResult]:
        try:
            return self._sent.parts(
                tick=self._tick,
                soft_stop_s=SOFT_STOP_S,
                watch_hangs=False,  # the watchdog watches the steps instead
                settle_deaths=not self.restart_on_death,
            )
        except RankError:
            self._stream.abandon()  # (results that may never come are not waited for)
            raise
        finally:
            # The monitor's last read and the dashboard's final state come before the result.
            self._stream.join(timeout=LAST_PUBLICATION_S + MONITOR_S * 50)
            self._presenter.close(self._stream.progress)

    def show(self) -> None:
        """Display the dashboard in the notebook (what ``%axon_dashboard`` does)."""
        self._presenter.show()

    def stop(self, timeout: float | None = None) -> TrainResult:
        """Stop every rank at the same step boundary and return the result so far (a run
        that has not begun stops after its first step)."""
        self.request_stop()
        return self.wait(timeout)

    def request_stop(self) -> None:
        """Ask every rank to stop at the same step boundary, without waiting for the run to
        end: a SIGINT once each rank is training (``train/training_begun.py``; a run that
        has not begun stops after its first step). What the lab sidebar's stop does::

            handle.request_stop()
            result = handle.wait()
        """
        wait_until_training(
            self._targets, lambda: self.latest, lambda: self.done, streams=self._spec.streams
        )
        if not self.done:
            self._cluster.interrupt(self._targets)

    def _tick(self) -> None:
        """Redraw the text bar (``train/progress.py``), where no dashboard is shown."""
        self._presenter.tick(self._stream.progress)

    def _running(self) -> bool:
        return not self.done

    def __repr__(self) -> str:
        state = "done" if self.done else "running"
        history = self.history
        at = history[-1]["step"] if history else 0
        return f"<TrainHandle {self.name!r} {state}, step {at}>"
