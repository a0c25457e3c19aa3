"""Engines in a Slurm job survive the job's preemption notice: Slurm sends it
(``--signal=USR2@90``, ``scancel --signal=USR2``) to every process of the job's steps, and
hydra's processes (``mpiexec``, its ``hydra_pmi_proxy`` on each node) end on USR2, taking the
ranks with them. The proxies are started through :func:`write_srun_wrapper`'s ``srun``
(hydra's ``HYDRA_LAUNCHER_EXEC``), under ``trap '' USR2``: an ignored signal stays ignored
across ``exec``. The ranks take the notice (``rank/preemption.py``).

Example (``cluster/launchers.py``)::

    environment["HYDRA_LAUNCHER_EXEC"] = write_srun_wrapper(log_dir, "USR2")
"""

from __future__ import annotations

import os
import sys

WRAPPER = """#!{python}
# srun for hydra's proxies: each runs under `trap '' {signal}`, so the preemption notice Slurm
# sends to every process of the step does not end it (axon_nb/cluster/slurm_notice.py).
import os, sys

args = sys.argv[1:]
at = next((i for i, a in enumerate(args) if "hydra_pmi_proxy" in os.path.basename(a)), None)
if at is not None:
    args[at:at] = ["/bin/sh", "-c", "trap '' {signal}; exec \\"$0\\" \\"$@\\""]
os.execvp("srun", ["srun", *args])
"""


def write_srun_wrapper(directory: str, signal_name: str) -> str:
    """Write the ``srun`` wrapper into ``directory`` (owner-only); its path."""
    path = os.path.join(directory, f"axon-srun-{signal_name}")
    text = WRAPPER.replace("{python}", sys.executable).replace("{signal}", signal_name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path
