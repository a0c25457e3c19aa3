"""How long each step of stopping a cluster waits: the one place these numbers live.

Every stop path (``Cluster.stop``, ``restart``, kernel exit, the reaper after a killed kernel)
escalates the same way:

1. **ask**: the engines get a shutdown request; an idle engine exits 0 at once.
2. **SIGTERM**: each rank's parent (``axon_nb.rank.world.launch``, on every host) and the MPI
   launcher get SIGTERM; the parent passes it to its engine.
3. **SIGKILL**: a rank's parent SIGKILLs its engine's whole process tree (engine and nanny)
   :data:`TERM_S` after its SIGTERM, so a rank busy in a cell, stuck in a collective or holding
   the GIL in native code ends too; the kernel (or the reaper) SIGKILLs whatever is left of
   the cluster's processes on this host :data:`KILL_AFTER_S` after its own SIGTERM.

Worst case: ``ASK_S + KILL_AFTER_S`` plus a poll, under the 10 s the README promises
(``REAPER_POLL_S`` more after a SIGKILLed kernel, under 15 s).
"""

from __future__ import annotations

ASK_S = 2.0
"""Wait for engines asked to exit before signalling them (skipped when a rank is known dead
or busy: a busy engine does not act on the request until its cell ends; busy also with
another kernel's run on a detached cluster)."""

TERM_S = 3.0
"""A rank's parent waits this long after passing SIGTERM on, then SIGKILLs the engine's tree."""

KILL_AFTER_S = TERM_S + 1.0
"""The kernel or reaper SIGKILLs what is left on this host this long after its SIGTERM."""

LAUNCHER_GRACE_S = 0.5
"""Once every rank under a launcher (``mpiexec``) has ended, the launcher gets this long to
exit on its own before it is SIGKILLed too, instead of the rest of ``KILL_AFTER_S``."""

REAPER_POLL_S = 0.5
"""How often the reaper checks that the kernel that started the cluster is alive."""
