"""A series of checkpoints in one directory, as ``train(checkpoint_dir=...)`` writes them:
``<dir>/step-00000050``, ``<dir>/step-00000100``, ... Plain Python, read by both sides.

Example::

    latest("ckpt/run1")          # the newest complete one, or None
"""

from __future__ import annotations

import glob
import os
import re
import shutil

from axon_nb.spec.checkpoint_format import MARKER, Checkpoint

NAME = re.compile(r"step-(\d{8})$")


def path_for(directory: str, step: int) -> str:
    """Where the checkpoint of ``step`` goes in ``directory``."""
    return os.path.join(os.path.abspath(directory), f"step-{step:08d}")


def checkpoints(directory: str) -> list[str]:
    """Complete checkpoints of the series in ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    return [
        os.path.join(os.path.abspath(directory), name)
        for name in sorted(os.listdir(directory))
        if NAME.match(name) and os.path.isfile(os.path.join(directory, name, MARKER))
    ]


def latest(directory: str) -> Checkpoint | None:
    """The newest complete checkpoint in ``directory`` (None if there is none)."""
    found = checkpoints(directory)
    return Checkpoint.read(found[-1]) if found else None


def remove_partial(directory: str) -> list[str]:
    """Remove what interrupted writes of the series left behind; returns what was removed."""
    partial = sorted(
        glob.glob(os.path.join(glob.escape(os.path.abspath(directory)), "step-*.partial-*"))
    )
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial
