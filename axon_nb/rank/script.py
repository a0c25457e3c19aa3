"""Run an unmodified torchrun-style script from a rank, as a fresh process with its own world.

The script sees the environment torchrun gives its workers (:func:`torchrun_env`) on a new
rendezvous port, so its own ``init_process_group`` and ``destroy_process_group`` never touch
the engine's world, which stays usable afterwards. None of the engine's MPI variables
(``PMI_*``, ``HYDI_*``, ``MPIR_*``, ``OMPI_*``, ...) reach it: a script may start MPI itself
(``mpiexec -n 2 python script.py`` inside it, or a singleton ``from mpi4py import MPI``).
"""

from __future__ import annotations

import os
import subprocess
import sys

from axon_nb.rank import runtime
from axon_nb.rank.world.rendezvous_port import free_port

TERMINATE_GRACE_S = 5.0


class ScriptError(RuntimeError):
    """The script exited with a non-zero status on this rank."""


def run_script(path: str, args: list[str], cwd: str) -> int:
    """Run ``python path *args`` as this rank of a fresh world; stream its output; return 0."""
    import torch.distributed as dist

    ctx = runtime.context()
    port = [free_port() if ctx.rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    env = torchrun_env(dict(os.environ), ctx, port[0])
    proc = subprocess.Popen(
        [sys.executable, path, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        bufsize=1,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
        code = proc.wait()
    finally:
        _terminate(proc)  # Ctrl-C (KeyboardInterrupt here) must not leave the script running
    if code != 0:
        raise ScriptError(f"{os.path.basename(path)} exited with status {code}")
    return code


MPI_PREFIXES = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPIR_", "MPICH_", "OMPI_", "I_MPI_", "MPI_")
"""Variables an MPI launcher sets for the engine's own MPI process, which a child process
would take for its own (``PMI_Init returned -1``)."""


def torchrun_env(environ: dict[str, str], ctx: runtime.RankContext, port: int) -> dict[str, str]:
    """``environ`` without the engine's MPI variables, plus what torchrun sets for worker
    ``ctx.rank`` (one worker group, one restart attempt). Example::

        torchrun_env(dict(os.environ), runtime.context(), 29500)["ROLE_RANK"]   # "3"
    """
    env = {k: v for k, v in environ.items() if not k.startswith(MPI_PREFIXES)}
    group_rank = ctx.rank // ctx.local_world_size  # the host's index, torchrun's node rank
    env |= {
        "RANK": str(ctx.rank),
        "WORLD_SIZE": str(ctx.world_size),
        "LOCAL_RANK": str(ctx.local_rank),
        "LOCAL_WORLD_SIZE": str(ctx.local_world_size),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(ctx.world_size // ctx.local_world_size),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(ctx.rank),
        "ROLE_WORLD_SIZE": str(ctx.world_size),
        "MASTER_ADDR": ctx.master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "PYTHONUNBUFFERED": "1",
    }
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with several workers per host
    return env


def _terminate(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
