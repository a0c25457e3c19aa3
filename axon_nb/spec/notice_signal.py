"""The preemption notice's signal (``USR2`` by default): which signals may be one, for batch
jobs (``axon_nb.submit``) and for clusters (``Cluster(preempt_signal=...)``).

Pure Python: the kernel checks it, the ranks install a handler for it.

Example::

    signum = notice_signum(check_notice_signal("USR2", cluster=True))   # signal.SIGUSR2
"""

from __future__ import annotations

import signal

ENV = "AXON_NB_PREEMPT_SIGNAL"
"""How a cluster's ranks learn their notice signal (set in their environment at start)."""

_TAKEN = {
    "SIGUSR1": "axon_nb's stack-dump signal (and NCCL's)",
    "SIGINT": "a stop",
    "SIGKILL": "uncatchable",
    "SIGSTOP": "uncatchable",
}


def check_notice_signal(name: str, *, cluster: bool) -> str:
    """``name`` as Slurm writes it (``USR2``), or ValueError saying why it cannot be the
    notice. On a cluster SIGTERM stays axon_nb's stop; for a job, ``cancel()`` on this host
    sends it (a Slurm job takes it as a notice anyway: Slurm's preemption sends it)."""
    wanted = f"SIG{str(name).upper().removeprefix('SIG')}"
    taken = {**_TAKEN, "SIGTERM": "axon_nb's stop of a rank" if cluster else "cancel()"}
    if not hasattr(signal, wanted) or wanted in taken:
        why = f" ({taken[wanted]})" if wanted in taken else ""
        raise ValueError(
            f"preempt_signal={name!r} cannot be the notice{why}: use USR2 (the default), or "
            "another catchable signal such as URG"
        )
    return wanted.removeprefix("SIG")


def notice_signum(name: str) -> int:
    """The signal number of ``name`` (``USR2`` or ``SIGUSR2``)."""
    return int(getattr(signal, f"SIG{name.upper().removeprefix('SIG')}"))
