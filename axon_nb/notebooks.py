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

_SOCKET_PATH_MAX = 107  # Linux's sun_path, less its closing NUL


def ipc_kernel_options() -> dict[str, str]:
    """Options for a ``jupyter_client`` kernel manager whose kernel listens on IPC sockets.

    The sockets lie beside a fresh connection file in the user's Jupyter runtime directory
    (mode 0700). Over TCP the manager picks free ports and the kernel binds them a moment
    later, and any process's outgoing connection may take one in between: the kernel then
    dies with "Address already in use" before it replies. IPC sockets have no such gap, and
    no other user can reach them. A runtime directory whose path is too long for a socket's
    (107 bytes) gives no options: TCP, as jupyter_client does by default.

    Example::

        km = KernelManager(kernel_name="python3", **ipc_kernel_options())
        km.start_kernel()
    """
    from jupyter_core.paths import jupyter_runtime_dir
    from jupyter_core.utils import ensure_dir_exists

    runtime = jupyter_runtime_dir()
    ensure_dir_exists(runtime, 0o700)
    connection_file = os.path.join(runtime, f"kernel-axon-{uuid.uuid4().hex[:12]}.json")
    if len(os.fsencode(connection_file)) > _SOCKET_PATH_MAX - len("-ipc-99"):
        return {}  # (a socket's path has at most 107 bytes: TCP, jupyter_client's default)
    return {"transport": "ipc", "connection_file": connection_file}


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
