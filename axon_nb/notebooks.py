"""Run example notebooks headlessly in a real Jupyter kernel (used by ``make demo`` and tests)."""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import nbformat
    from jupyter_client.blocking import BlockingKernelClient
    from jupyter_client.manager import KernelManager

_SOCKET_PATH_MAX = 107  # a Unix socket's path on Linux (sun_path, less its closing NUL)
_KERNELS_DIR = "axon-kernels"


def ipc_kernel_options() -> dict[str, str]:
    """Options for a ``jupyter_client`` kernel manager whose kernel listens on IPC sockets.

    The sockets lie beside a fresh connection file in ``<Jupyter runtime dir>/axon-kernels``
    (made 0700, checked as the detached clusters' directory is). Over TCP the manager picks
    free ports and the kernel binds them a moment later, and any process's outgoing
    connection may take one in between: the kernel then dies with "Address already in use"
    before it replies. IPC sockets have no such gap, and no other user can reach them. A
    runtime directory others can write to, or one too deep for a socket's path (107 bytes),
    gives no options: TCP, jupyter_client's default.

    Example::

        km = KernelManager(kernel_name="python3", **ipc_kernel_options())
        km.start_kernel()
    """
    from jupyter_core.paths import jupyter_runtime_dir

    from axon_nb.cluster.detached import private_runtime_dir
    from axon_nb.errors import AxonError

    directory = Path(jupyter_runtime_dir()).absolute() / _KERNELS_DIR
    connection_file = directory / f"kernel-{uuid.uuid4().hex[:12]}.json"
    # (the sockets are "<connection file less .json>-ipc-<n>", n counted from 1)
    if len(os.fsencode(connection_file.with_suffix(""))) + len("-ipc-99") > _SOCKET_PATH_MAX:
        return {}
    try:
        private_runtime_dir(_KERNELS_DIR)  # (made 0700 if missing; refused unless owner-only)
    except AxonError:
        return {}
    return {"transport": "ipc", "connection_file": str(connection_file)}


def start_kernel(startup_timeout: float = 60) -> tuple[KernelManager, BlockingKernelClient]:
    """Start a ``python3`` kernel and its client, as ``jupyter_client.start_new_kernel``
    does, on the IPC sockets of :func:`ipc_kernel_options`.

    Example::

        km, kc = start_kernel()
        kc.execute_interactive("print(1)")
        km.shutdown_kernel()
    """
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3", **ipc_kernel_options())
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=startup_timeout)
    except RuntimeError:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        raise
    return km, kc


def execute(path: Path, output: Path, *, timeout: int = 600) -> nbformat.NotebookNode:
    """Execute ``path`` top to bottom in a fresh ``python3`` kernel and write it to ``output``.

    Example::

        execute(Path("examples/quickstart.ipynb"), Path("build/quickstart.ipynb"))
    """
    import nbformat  # (imported here: 1.3 s, which importing this module need not take)
    from nbclient import NotebookClient
    from traitlets.config import Config

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": "."}},
        config=Config(KernelManager=ipc_kernel_options()),
    )
    try:
        client.execute()
    finally:
        output.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, output)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    output = args.output or Path("build") / args.notebook.name
    nb = execute(args.notebook, output)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                sys.stdout.write(out["text"])
    print(f"\nExecuted notebook written to {output.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
