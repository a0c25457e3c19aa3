"""``cluster.save(path, format="hf")``: a trained model as a ``save_pretrained`` directory.

The ranks gather the model and rank 0 writes it with the model's own ``save_pretrained``
(``axon_nb.rank.checkpoint.hf_export``) into a partial directory beside ``path``, which
replaces ``path`` only once complete.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from axon_nb.rank import entry

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike

MARKERS = ("config.json", "adapter_config.json")
"""Files that make a directory a ``save_pretrained`` one (a model, or a PEFT adapter)."""


def save_pretrained(
    cluster: ClusterLike, path: str | os.PathLike[str], *, name: str, overwrite: bool
) -> Path:
    """Write run ``name`` to ``path`` for ``from_pretrained``; the directory. Example::

    cluster.save("out/llama-lora", format="hf")
    PeftModel.from_pretrained(base, "out/llama-lora")   # a PEFT model: its adapter
    """
    target = Path(os.path.abspath(os.fspath(path)))
    if target.exists() or target.is_symlink():
        if not overwrite:
            raise FileExistsError(
                f"{target} already exists; pass overwrite=True to replace it (it stays until "
                "the new one is complete), or choose another path"
            )
        if not target.is_dir() or not any((target / m).exists() for m in MARKERS):
            raise FileExistsError(
                f"{target} exists and is not a save_pretrained directory (no "
                f"{' or '.join(MARKERS)}); it will not be replaced. Choose another path"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.partial-{uuid.uuid4().hex[:12]}")
    try:
        cluster.run(entry.save_pretrained, name, str(partial))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # incomplete: nothing to keep
        raise
    # Complete from here on: a failure to move it in leaves it in ``partial`` (the error names
    # both paths) and the old directory back at ``target``.
    if target.exists():
        old = target.with_name(f"{target.name}.old-{uuid.uuid4().hex[:8]}")
        target.rename(old)
        try:
            partial.rename(target)
        except OSError:
            old.rename(target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        partial.rename(target)
    return target
