"""The process ``mpiexec`` starts for each rank: it runs the rank's engine as its child.

MPICH's per-host proxy kills every rank on its host when any of its children is killed by a
signal, whatever ``-disable-auto-cleanup`` says. A rank killed by the OOM killer or a SIGKILL
would take the survivors' model state with it, and ``cluster.rescue`` could not save it. This
parent turns the engine's death by a signal into an ordinary exit status (128 + signal), so
the proxy only notifies the other ranks and they live on.

The engine inherits the environment and every file descriptor (MPI's ``PMI_FD`` among them),
and it shares this process group, so the signals ``mpiexec`` sends to the group reach it
directly. Usage (what ``cluster/launchers.py`` configures)::

    mpiexec -n 4 python -m axon_nb.rank.launch python -m ipyparallel.engine --mpi
"""

from __future__ import annotations

import signal
import subprocess
import sys

_PASSED_TO_THE_GROUP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _ignore(signum: int, frame: object) -> None:
    """The engine, in the same process group, received this signal too and acts on it."""


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m axon_nb.rank.launch COMMAND [ARGS...]", file=sys.stderr)
        return 2
    # Hydra's notice that another rank failed. SIG_IGN is inherited through exec, so the
    # engine ignores it too until its watch thread registers faulthandler on it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    for signum in _PASSED_TO_THE_GROUP:  # handlers (not SIG_IGN) reset to default in the child
        signal.signal(signum, _ignore)
    child = subprocess.Popen(argv, close_fds=False)
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
