"""Bringing a started engine set to a joined world: waiting for engines to connect (and
noticing ranks that exit first), then having every rank join the torch world."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import ipyparallel as ipp

from axon_nb.cluster import relay, stopping
from axon_nb.cluster.iopub_guard import guard_iopub
from axon_nb.cluster.logs import ClusterLog
from axon_nb.cluster.options import ClusterOptions
from axon_nb.cluster.rank_processes import RankProcesses
from axon_nb.cluster.sending import dispatch
from axon_nb.cluster.waiting import results
from axon_nb.errors import AxonError, ClusterStartError, RankError
from axon_nb.rank import entry
from axon_nb.spec.bootstrap_spec import BootstrapSpec
from axon_nb.spec.placement import PlacementError, plan_world

GAVE_UP = "Registration timed out"
"""What an ipyparallel engine logs when the controller did not answer its registration."""

Wait = Callable[[ipp.AsyncResult, list[int]], dict[int, ipp.AsyncResult]]
"""Waits for one message per rank (``Cluster.wait`` with the start timeout)."""


PORT_TAKEN = "Address already in use"
"""What the controller logs when a port it picked was taken before it bound it: its ports are
chosen free, then bound a moment later, and on a busy host another process may come between."""

PORT_TAKEN_WHY = "a port the controller picked was taken before it bound it"

TRACEBACK = "Traceback (most recent call last)"
"""What the controller's output holds once its start raised."""

CONTROLLER_ATTEMPTS = 3
"""Tries of a whole start (new controller ports each time) before a taken port fails it, lost
before or after the controller wrote its connection file."""

CONNECT_TRY_S = 2.0
"""How long one connection attempt waits for the controller's answer before the start checks
that the controller is still sound and tries again."""


class PortRace(ClusterStartError):
    """The controller failed because a port it had picked was taken before it bound it (its
    broadcast schedulers bind theirs after it has written its connection file): the whole start
    is tried again, with new ports."""


def retrying_port_races(launch: Callable[[], None]) -> None:
    """``launch()``, tried again while it fails with :class:`PortRace`, up to
    ``CONTROLLER_ATTEMPTS`` tries in all."""
    for attempt in range(1, CONTROLLER_ATTEMPTS + 1):
        try:
            launch()
            return
        except PortRace:
            if attempt == CONTROLLER_ATTEMPTS:
                raise


def start_error(error: BaseException, lost_a_port: bool, log: ClusterLog | None) -> BaseException:
    """What a failed start raises: ``error`` itself for a Ctrl-C or one of ours that already
    names the log, else a :class:`ClusterStartError` (a :class:`PortRace` when the controller
    lost a port) ending with the end of the cluster's log."""
    if isinstance(error, KeyboardInterrupt):
        return error  # never tried again
    tail = log_tail(log)
    if lost_a_port:
        # (the controller's traceback can be seen before its last line names the taken port)
        why = "" if PORT_TAKEN_WHY in str(error) else f": {PORT_TAKEN_WHY}"
        return PortRace(f"{error}{why}\n{tail}")
    if isinstance(error, ClusterStartError) and "cluster's log" not in str(error):
        return ClusterStartError(f"{error}\n{tail}")
    if isinstance(error, AxonError):
        return error
    return ClusterStartError(f"{error}\n{tail}")


def controller_output(cluster: ipp.Cluster) -> str:
    """What the controller has printed so far (read afresh; see :func:`read_output`)."""
    path = getattr(cluster.controller, "output_file", "")
    if not path or not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def controller_failure(cluster: ipp.Cluster) -> str | None:
    """Why ``cluster``'s controller cannot serve, or None. A controller whose start raised may
    live on (its scheduler threads keep the process) without ever answering."""
    controller = cluster.controller
    if controller is None or controller.state == "after":
        return "the controller exited while the cluster was starting"
    output = controller_output(cluster)
    if PORT_TAKEN in output:
        return PORT_TAKEN_WHY
    if TRACEBACK in output:
        return "the controller failed while starting"
    return None


TRACEBACK_END_MAX_S = 10.0
"""At most this long is waited for a failing controller's traceback to be written to its end:
on a busy host it is written in parts, seconds apart, and the line naming the taken port comes
last (a wait for the output to stop growing for 0.5 s was seen to read it half-written)."""


EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(: |$)")
"""The line that ends a traceback, naming the exception (``zmq.error.ZMQError: ...``); a log
line another thread writes meanwhile starts with a date or a bracket."""


def traceback_ended(text: str) -> bool:
    """Whether the last traceback in ``text`` is written to its end: after its frames (indented
    lines) comes the line naming the exception, newline included."""
    _, header, rest = text.rpartition(TRACEBACK)
    if not header:
        return False
    lines = rest.split("\n")[1:-1]  # whole lines after the header's
    return any(EXCEPTION_LINE.match(line) for line in lines)


def finished_traceback(read: Callable[[], str], max_s: float) -> str:
    """``read()`` once the last traceback in it is written to its end, or after ``max_s``."""
    deadline = time.monotonic() + max_s
    text = read()
    while not traceback_ended(text) and time.monotonic() < deadline:
        time.sleep(0.05)
        text = read()
    return text


def port_was_taken(cluster: ipp.Cluster, log: ClusterLog | None) -> bool:
    """Whether the controller failed because a port it picked was taken meanwhile."""
    output = controller_output(cluster)
    if TRACEBACK in output and PORT_TAKEN not in output:
        output = finished_traceback(lambda: controller_output(cluster), TRACEBACK_END_MAX_S)
    return port_taken_in_log(log) or PORT_TAKEN in output


def port_taken_in_log(log: ClusterLog | None) -> bool:
    """Whether the cluster's log says a port was taken (the controller's output is copied there
    when the cluster stops)."""
    return log is not None and PORT_TAKEN in log.tail(400)


def connect_client(cluster: ipp.Cluster, timeout: float) -> ipp.Client:
    """A client connected to ``cluster``'s controller within ``timeout`` seconds, failing as
    soon as the controller has failed (it can, after writing its connection file) instead of
    waiting out the whole timeout."""
    deadline = time.monotonic() + timeout
    while True:
        failure = controller_failure(cluster)
        if failure is not None:
            raise ClusterStartError(failure)
        wait = min(CONNECT_TRY_S, max(deadline - time.monotonic(), 0.1))
        try:
            client = cluster.connect_client_sync(timeout=wait)
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise ClusterStartError(
                    f"the controller did not answer within {timeout:.0f} s"
                ) from None
        else:
            guard_iopub(client)  # (one message it cannot handle no longer ends its output)
            return client


def wait_for_engines(
    cluster: ipp.Cluster, client: ipp.Client, options: ClusterOptions, log: ClusterLog | None = None
) -> None:
    """Wait for all engines to connect, failing fast when a local rank process has exited, or
    when an engine gave up registering (it then stays alive without ever connecting: the
    "0 of N engines connected" failure, when its registration timeout was ipyparallel's 5 s
    and the controller answered later under load)."""
    n, timeout = options.n, options.start_timeout
    started = time.monotonic()
    seen: set[int] = set()  # engine processes that were alive at some point
    parents_seen: set[int] = set()  # rank parents, likewise (one exits only with its engine)
    short_since: float | None = None  # since when an engine runs but a rank is missing
    local = options.engines == "mpi" and not options.multi_host
    ranks = RankProcesses(lambda: [launcher.pid for launcher in cluster.engines.values()], n)
    log_end = 0  # how far the log was searched for GAVE_UP
    with _registrations(client) as registered:
        while len(client.ids) < n:
            now = time.monotonic()
            parents, alive = ranks.poll() if local else ([], set())
            seen |= alive
            parents_seen |= set(parents)
            failure = controller_failure(cluster)
            if failure is not None:
                raise ClusterStartError(failure)
            # First: an engine that gave up exits a second later (ipyparallel's abort), and
            # its giving up is the cause to name. (The log is read from a little before the
            # last read's end: a line split.)
            if log is not None:
                text, log_end = log.read_from(log_end - len(GAVE_UP))
                if GAVE_UP in text:
                    raise ClusterStartError(
                        f"an engine gave up registering with the controller ({len(client.ids)} of "
                        f"{n} engines connected): the controller did not answer in time"
                    )
            # (an engine forked from the warm process may end before any poll sees it, and
            # ipyparallel may not have noticed its launcher's exit yet)
            launchers = list(cluster.engines.values())
            stopped = any(launcher.state == "after" for launcher in launchers) or (
                local and any(p.pid and not stopping.alive(p.pid) for p in launchers)
            )
            # A rank process that exited at once may never be seen (and the others then wait in
            # MPI_Init for it): MPI's proxy starts them all together, so once an engine runs,
            # every rank's parent is there, or was.
            missing = local and seen and len(parents) < n
            short_since = (short_since or now) if missing else None
            # A rank's engine that was running and is gone has exited (on a busy host the others
            # may not have been spawned yet: their absence says nothing).
            gone = short_since is not None and now - short_since > MISSING_RANK_S
            if stopped or seen - alive or parents_seen - set(parents) or gone:
                raise ClusterStartError(
                    f"a rank exited while starting ({len(client.ids)} of {n} engines connected)"
                )
            if now - started > timeout:
                raise ClusterStartError(
                    f"only {len(client.ids)} of {n} engines connected within {timeout:.0f} s"
                )
            registered.wait(POLL_S)  # (woken early by an engine's registration)
            registered.clear()


POLL_S = 0.2
"""How often a start looks at its rank processes and its log while engines connect."""


@contextlib.contextmanager
def _registrations(client: ipp.Client) -> Iterator[threading.Event]:
    """An event the client's IO thread sets as each engine registers, so that a start goes
    on at once rather than up to ``POLL_S`` later (the hook ipyparallel's own
    ``wait_for_engines`` uses; where it is missing the event is never set and a start polls)."""
    event = threading.Event()

    def hook(_event: dict[str, Any]) -> None:
        event.set()

    # (replaced, not changed in place: the IO thread may be going through the old list)
    hooked = isinstance(getattr(client, "_registration_callbacks", None), list)
    if hooked:
        client._registration_callbacks = [*client._registration_callbacks, hook]
    try:
        yield event
    finally:
        if hooked:
            client._registration_callbacks = [
                c for c in client._registration_callbacks if c is not hook
            ]


MISSING_RANK_S = 10.0
"""How long a local rank's process may be missing once an engine runs before the start fails
(they are started together; a busy host still runs each within this)."""


def join_world(
    client: ipp.Client,
    options: ClusterOptions,
    wait: Wait,
    watch_dir: str | None = None,
    kernel_addr: str | None = None,
) -> list[dict[str, Any]]:
    """Every rank joins the torch world (and watches ``watch_dir``); summaries in rank order.
    Across hosts, ``kernel_addr`` is this host's address on the ranks' network."""
    spec = bootstrap_spec(options, watch_dir, kernel_addr)
    targets = sorted(client.ids)
    try:
        if options.engines in ("mpi", "slurm"):
            ar = dispatch(client, targets, entry.bootstrap_mpi, spec)
            summaries = results(wait(ar, targets))
        else:
            summaries = _join_planned_by_kernel(client, spec, targets, wait)
    except RankError as e:
        if e.ename == "PlacementError":
            raise ClusterStartError(e.evalue) from None
        raise ClusterStartError(f"rank {e.rank} failed to start: {e}\n{e.traceback}") from None
    mismatched = [(t, s["rank"]) for t, s in zip(targets, summaries, strict=True) if t != s["rank"]]
    if mismatched:
        raise ClusterStartError(f"engine ids and ranks differ: {mismatched}")
    addresses = results(wait(dispatch(client, targets, entry.open_relay), targets))
    relay.register(client, {
        s["rank"]: (s["host"], address) for s, address in zip(summaries, addresses, strict=True)
    })  # fmt: skip
    return summaries


def bootstrap_spec(
    options: ClusterOptions, watch_dir: str | None, kernel_addr: str | None
) -> BootstrapSpec:
    """What the kernel asks of every rank that joins a world (at start, and a resize's)."""
    return BootstrapSpec(
        backend=options.backend,
        gpus=options.gpus,
        timeout_s=options.timeout,
        watch_dir=watch_dir,
        iface=options.iface,
        kernel_addr=kernel_addr,
        kernel_host=socket.gethostname(),
    )


def merged(client: ipp.Client, ars: list[ipp.AsyncResult], targets: list[int]) -> ipp.AsyncResult:
    """One ``AsyncResult`` over per-rank messages (each rank its own arguments), in
    ``targets`` order. Made of the parts' futures, not their message ids: the client forgets a
    relayed part once it is in (``relay.Relay._forget``), and one that failed at once (before
    the next rank's part was even sent) would then be found nowhere."""
    return ipp.AsyncResult(client, [f for a in ars for f in a._children], targets=targets)


def _join_planned_by_kernel(
    client: ipp.Client, spec: BootstrapSpec, targets: list[int], wait: Wait
) -> list[dict[str, Any]]:
    """Engines without MPI: all on this host; the kernel plans, each rank joins."""
    probes = results(
        wait(dispatch(client, targets, entry.probe_by_engine_id, len(targets)), targets)
    )
    try:
        plans = plan_world(probes, backend=spec.backend, gpus=spec.gpus)
    except PlacementError as e:
        raise ClusterStartError(str(e)) from None
    ars = [  # each its own plan: a message each
        dispatch(client, [t], entry.join_world, plans[t], spec.timeout_s, spec.watch_dir)
        for t in targets
    ]
    return results(wait(merged(client, ars, targets), targets))


def log_tail(log: ClusterLog | None, lines: int = 15) -> str:
    """The end of the cluster's log and where the whole of it is, to explain a failure."""
    return "" if log is None else log.ending(lines)


def copy_launcher_output(cluster: ipp.Cluster, log: ClusterLog) -> None:
    """Append what the controller and MPI launcher printed to the cluster's log (ipyparallel
    removes its own files when it stops)."""
    for launcher in [*cluster.engines.values(), cluster.controller]:
        if launcher is None:
            continue
        try:
            text = read_output(launcher).strip()
        except Exception:
            continue
        if text:
            log.logger.info("output of %s:\n%s", launcher.identifier, text)


def read_output(launcher: Any) -> str:
    """What a launcher's process printed, read once and kept where ipyparallel looks for it.

    Ranks write to one output file concurrently, so a character's bytes may be split by
    another rank's write; ipyparallel reads the file as strict UTF-8 (and fails while stopping
    the cluster), so it is read here first, replacing undecodable bytes."""
    if getattr(launcher, "_output", None) is None:
        path = getattr(launcher, "output_file", "")
        text = ""
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        launcher._output = text
    return str(launcher._output)
