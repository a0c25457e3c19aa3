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

ALLOWED = ("USR2", "URG", "HUP", "ALRM", "XCPU", "PWR")
"""Signals a notice may be: sent by hand or by a batch system, never by the system for
another reason (CHLD, PIPE, WINCH, SEGV... come for other reasons)."""

_TAKEN = {
    "USR1": "axon_nb's stack-dump signal (and NCCL's)",
    "INT": "a stop",
    "TERM": "axon_nb's stop of a rank",
}


def check_notice_signal(name: str, *, cluster: bool) -> str:
    """``name`` as Slurm writes it (``USR2``), or ValueError saying why it cannot be the
    notice. SIGTERM is a stop (on a cluster) or ``cancel()`` (a job); a Slurm job takes it as
    a notice anyway, since Slurm's preemption sends it."""
    wanted = str(name).upper().removeprefix("SIG")
    if wanted not in ALLOWED or not hasattr(signal, f"SIG{wanted}"):
        taken = {**_TAKEN, "TERM": _TAKEN["TERM"] if cluster else "cancel()"}
        why = f" ({taken[wanted]})" if wanted in taken else ""
        raise ValueError(
            f"preempt_signal={name!r} cannot be the notice{why}: use USR2 (the default) or "
            f"one of {', '.join(ALLOWED[1:])}"
        )
    return wanted


def notice_signum(name: str) -> int:
    """The signal number of ``name`` (``USR2`` or ``SIGUSR2``)."""
    return int(getattr(signal, f"SIG{name.upper().removeprefix('SIG')}"))
