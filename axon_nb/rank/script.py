"""Run an unmodified torchrun-style script from a rank, as a fresh process with its own world.

The script sees the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) on a new rendezvous port, so its own ``init_process_group`` and
``destroy_process_group`` never touch the engine's world, which stays usable afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys

from axon_nb.rank import runtime
from axon_nb.rank.bootstrap import free_port

TERMINATE_GRACE_S = 5.0


class ScriptError(RuntimeError):
    """The script exited with a non-zero status on this rank."""


def run_script(path: str, args: list[str], cwd: str) -> int:
    """Run ``python path *args`` as this rank of a fresh world; stream its output; return 0."""
    import torch.distributed as dist

    ctx = runtime.context()
    port = [free_port() if ctx.rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    env = os.environ | {
        "RANK": str(ctx.rank),
        "WORLD_SIZE": str(ctx.world_size),
        "LOCAL_RANK": str(ctx.local_rank),
        "LOCAL_WORLD_SIZE": str(ctx.local_world_size),
        "MASTER_ADDR": ctx.master_addr,
        "MASTER_PORT": str(port[0]),
        "PYTHONUNBUFFERED": "1",
    }
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


def _terminate(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
