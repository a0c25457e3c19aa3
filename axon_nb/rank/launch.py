"""The process ``mpiexec`` starts for each rank: it runs the rank's engine as its child.

MPICH's process managers end every rank when one is killed by a signal or leaves its MPI
connection unfinished (hydra's proxy whatever ``-disable-auto-cleanup`` says; gforker always).
A rank killed by the OOM killer or a SIGKILL would take the survivors' model state with it,
and ``cluster.rescue`` could not save it. This parent holds the rank's MPI connection (it
inherited it) and, when the engine is killed, stays until the cluster is stopped, so the
process manager sees nothing and the other ranks live on.

The engine inherits the environment and every file descriptor (MPI's ``PMI_FD`` among them).
It shares this process group (hydra signals the group), SIGINT, SIGTERM and SIGHUP sent to this
process are passed on to it (gforker signals its children only), and it is SIGKILLed if this
process dies, so stopping the launcher never leaves an engine behind. Usage (what
``cluster/launchers.py`` configures)::

    mpiexec -n 4 python -m axon_nb.rank.launch python -m ipyparallel.engine --mpi
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys

_PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """(In the child, before exec) be SIGKILLed when this parent dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m axon_nb.rank.launch COMMAND [ARGS...]", file=sys.stderr)
        return 2
    # Hydra's notice that another rank failed. SIG_IGN is inherited through exec, so the
    # engine ignores it too until its watch thread registers faulthandler on it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    child = subprocess.Popen(argv, close_fds=False, preexec_fn=_die_with_parent)
    stop = []

    def pass_on(signum: int, frame: object) -> None:
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)
        stop.append(signum)

    for signum in _PASSED_ON:
        signal.signal(signum, pass_on)
    code = child.wait()
    if code >= 0:
        return code
    # Killed by a signal. Exiting now would close this rank's MPI connection unfinished, on
    # which the process manager ends every other rank: keep the slot until the cluster stops.
    print(f"axon_nb: engine {child.pid} was killed by signal {-code}", file=sys.stderr, flush=True)
    while not stop:
        signal.pause()
    return 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
