"""The process ``mpiexec`` starts for each rank: it runs the rank's engine as its child, and
ends it whatever the engine is doing.

MPICH's process managers end every rank when one is killed by a signal or leaves its MPI
connection unfinished (hydra's proxy whatever ``-disable-auto-cleanup`` says; gforker always).
A rank killed by the OOM killer or a SIGKILL would take the survivors' model state with it,
and ``cluster.rescue`` could not save it. This parent holds the rank's MPI connection (it
inherited it) and, when the engine is killed, stays until the cluster is stopped, so the
process manager sees nothing and the other ranks live on.

Stopping (``axon_nb.spec.stop_waits``): SIGTERM or SIGHUP to this process, or the death of its
own parent (the MPI launcher or hydra's proxy on this host), is passed on to the engine as
SIGTERM; if the engine has not exited ``TERM_S`` later (busy in a cell, stuck in a collective,
holding the GIL in native code) its whole process tree (engine and nanny) is SIGKILLed.
SIGINT is passed on as it is. Once the engine has ended, this parent removes the
shared-memory files of notebook datasets it left (only a transfer cut short leaves any).

The engine inherits the environment and every file descriptor (MPI's ``PMI_FD`` among them)
except its output: with ``AXON_NB_ENGINE_LOG`` set (the cluster's owner-only log file) the
engine writes there, so no pipe of the MPI launcher lies between an engine and its log. It
shares this process group (hydra signals the group) and is SIGKILLed if this process dies.
Where the kernel runs a warm process for this host (``spec/warm_engines.py``) the engine is
forked from it instead (``rank/world/forked_engine.py``), with the same environment,
descriptors and death: this parent signals and waits for it the same way.
Usage (what ``cluster/launchers.py`` configures)::

    mpiexec -n 4 python -m axon_nb.rank.world.launch python -m axon_nb.rank.world.engine --mpi
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from axon_nb.rank.world.forked_engine import ForkedEngine
from axon_nb.spec.notice_signal import ENV as NOTICE_ENV
from axon_nb.spec.notice_signal import notice_signum
from axon_nb.spec.shared_data import leftovers
from axon_nb.spec.stop_waits import TERM_S
from axon_nb.spec.warm_engines import SERVER_ENV
from axon_nb.spec.world_change import RETIRED_EXIT

LOG_ENV = "AXON_NB_ENGINE_LOG"
"""The file the engine's output goes to (set by ``cluster/launchers.py``)."""

_PR_SET_PDEATHSIG = 1


def set_death_signal(signum: int) -> None:
    """Get ``signum`` when the parent of the calling process dies (Linux; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        pass


def _die_with_parent() -> None:
    """(In the child, before exec) be SIGKILLed when this parent dies."""
    set_death_signal(signal.SIGKILL)


def _engine_output() -> int | None:
    """The log file to give the engine as stdout and stderr, None to inherit ours."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError:  # another host, without the kernel's file system: mpiexec forwards it
        return None


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (collected first: the nanny, in a session
    of its own, would be re-parented once the engine is gone)."""
    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _remove_shared_files(pid: int) -> None:
    """Remove the shared-memory files engine ``pid`` left (``spec/shared_data.py``: each is
    unlinked once mapped, so only a transfer cut short leaves one)."""
    for path in leftovers(pid):
        with contextlib.suppress(OSError):
            os.unlink(path)


class _Stopping:
    """What the signal handlers saw: when the engine was told to stop (monotonic time), and
    the timer that SIGKILLs its tree ``TERM_S`` later unless it has ended by then."""

    since: float | None = None
    kill_timer: threading.Timer | None = None


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m axon_nb.rank.world.launch COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    set_death_signal(signal.SIGTERM)  # the MPI launcher died: stop the engine too
    # Hydra's notice that another rank failed. SIG_IGN is inherited through exec, so the
    # engine ignores it too until its watch thread registers faulthandler on it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # The preemption notice likewise, until a run takes it (``rank/preemption.py``): Slurm's
    # --signal reaches every process of the step, and USR2's default action ends a process.
    notice = notice_signum(os.environ.get(NOTICE_ENV, "USR2"))
    signal.signal(notice, signal.SIG_IGN)
    output = _engine_output()
    child = _start_engine(argv, output)
    if output is not None:
        os.close(output)
    stopping = _Stopping()

    def pass_on(signum: int, frame: object) -> None:
        if signum != signal.SIGINT and stopping.since is None:
            stopping.since = time.monotonic()
            signum = signal.SIGTERM
            stopping.kill_timer = threading.Timer(TERM_S, kill_tree, args=(child.pid,))
            stopping.kill_timer.daemon = True
            stopping.kill_timer.start()
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, pass_on)
    if isinstance(child, ForkedEngine):  # (not in this process group: hydra's notice, passed on)
        signal.signal(signal.SIGUSR1, lambda signum, frame: _send_quietly(child, signum))
    # (a notice sent to this process alone is the engine's too)
    signal.signal(notice, lambda signum, frame: _send_quietly(child, signum))
    if os.getppid() != parent:  # it died before the death signal was set
        pass_on(signal.SIGTERM, None)
    code = _wait(child, stopping)
    _remove_shared_files(child.pid)
    if code == RETIRED_EXIT and stopping.since is None:  # a resize let it go: keep the slot
        _park(stopping)
        return 0
    if code >= 0:
        return code
    if stopping.since is not None:  # ended by the stop: not a failure
        return 0
    # Killed by a signal. Exiting now would close this rank's MPI connection unfinished, on
    # which the process manager ends every other rank: keep the slot until the cluster stops.
    _say(f"axon_nb: the engine of this rank (pid {child.pid}) was killed by "
         f"{_signal_name(-code)}")  # fmt: skip
    _park(stopping)
    return 128 - code


def _signal_name(signum: int) -> str:
    """``signal 9 (SIGKILL)``; SIGKILL's usual senders named too."""
    try:
        name = f"signal {signum} ({signal.Signals(signum).name})"
    except ValueError:
        return f"signal {signum}"
    if signum == signal.SIGKILL:
        name += ": sent by `kill -9`, or by the system's OOM killer when memory ran out"
    return name


def _say(line: str) -> None:
    """Write ``line`` to the cluster's log, where the kernel's error about this rank shows
    the log's end (this process's own stderr goes to the MPI launcher's output)."""
    output = _engine_output()
    if output is not None:
        try:
            os.write(output, (line + "\n").encode())
            return
        except OSError:  # (a full disk, say: this parent must go on holding the rank's slot)
            pass
        finally:
            os.close(output)
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def _park(stopping: _Stopping) -> None:
    """Hold this rank's MPI slot, sleeping, until the cluster stops (SIGTERM or SIGHUP)."""
    while stopping.since is None:
        signal.pause()


def _send_quietly(child: subprocess.Popen[bytes] | ForkedEngine, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signum)


def _start_engine(argv: list[str], output: int | None) -> subprocess.Popen[bytes] | ForkedEngine:
    """The engine, forked by this host's warm process where the kernel started one
    (``spec/warm_engines.py``), else started as this process's child."""
    server = os.environ.get(SERVER_ENV)
    engine = ForkedEngine.start(server, argv, output) if server else None
    if engine is not None:
        return engine
    return subprocess.Popen(
        argv, close_fds=False, preexec_fn=_die_with_parent, stdout=output, stderr=output
    )


def _wait(child: subprocess.Popen[bytes] | ForkedEngine, stopping: _Stopping) -> int:
    """The engine's exit code. A blocking wait (this process uses no CPU while the engine
    runs); a stop's signal handler runs meanwhile and arms the SIGKILL of the engine's tree."""
    code = child.wait()
    if stopping.kill_timer is not None:
        stopping.kill_timer.cancel()  # its pid may be another process's soon
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
