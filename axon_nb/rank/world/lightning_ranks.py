"""Lightning on a rank: the ranks are processes launched for it, not an interactive session.

Lightning Fabric refuses ``Fabric(strategy="ddp")`` where it thinks it runs interactively
(``sys.ps1`` is set: IPython sets it, and every rank is an IPython engine), because there it
would have to launch the other processes by re-running the command line. On a rank the other
processes exist already (MPI launched them; ``LOCAL_RANK``, ``WORLD_SIZE`` and MPI tell
Lightning's cluster environments so) and the world is joined, which Fabric then uses as it
is. So Lightning's interactive flag (``_IS_INTERACTIVE`` of
``lightning.fabric.utilities.imports``, read by Fabric and by ``lightning.pytorch``) is
cleared on the ranks as that module is imported. Example (on a rank)::

    install()
    from lightning.fabric import Fabric
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy="ddp")
    fabric.launch()   # launches nothing: the ranks are the processes
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

FLAG_MODULES = ("lightning.fabric.utilities.imports", "lightning_fabric.utilities.imports")
"""Where Lightning (the umbrella package, or ``lightning-fabric`` alone) keeps the flag."""


class _ClearInteractive(importlib.abc.MetaPathFinder):
    """Finds :data:`FLAG_MODULES` as usual, then clears the flag once the module has run."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in FLAG_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType, run: Any = run) -> None:
            run(module)
            module.__dict__["_IS_INTERACTIVE"] = False

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # (this one loader)
        return spec


def install() -> None:
    """Clear the flag where Lightning is loaded already, and as it loads from now on (once)."""
    for name in FLAG_MODULES:
        if name in sys.modules:
            sys.modules[name].__dict__["_IS_INTERACTIVE"] = False
    if not any(isinstance(f, _ClearInteractive) for f in sys.meta_path):
        sys.meta_path.insert(0, _ClearInteractive())
