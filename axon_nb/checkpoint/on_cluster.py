"""``save``, ``load`` and ``rescue``: a training run's checkpoint, written and read by a
cluster's ranks."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from axon_nb.rank import entry
from axon_nb.spec.checkpoint_format import Checkpoint, plan_save

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike


def save(
    cluster: ClusterLike,
    path: str | os.PathLike[str],
    kind: str = "full",
    *,
    name: str = "model",
    overwrite: bool = False,
    private: bool = True,
    format: str = "torch",
) -> Checkpoint | Path:
    """Save training run ``name`` (model, optimizer, step, schedule) as a checkpoint.

    ``format="hf"`` writes the model alone as ``save_pretrained`` does (config and
    safetensors; a PEFT model's adapter alone) for ``from_pretrained``, from any strategy, and
    returns the directory (``axon_nb.checkpoint.pretrained``); ``kind`` does not apply.

    ``kind="full"``: the state is gathered and rank 0 writes one file (``torch.save``);
    ``kind="sharded"``: every rank writes its shards with ``torch.distributed.checkpoint``,
    which can be loaded on a different number of ranks. The checkpoint only appears at
    ``path`` once complete; an existing one is replaced only with ``overwrite=True``, and
    only after the new one is complete; anything else that appears at ``path`` meanwhile is
    left alone (the save fails and says where its checkpoint is). A failed save removes its
    partial directory. Directories are created 0o700 and files 0o600 (``private=False``: as
    the umask says). ``cluster.save(...)`` is the same call. Example::

        cluster.train(model=make_gpt, data=ds, strategy=FSDP(), steps=100)
        cluster.save("ckpt/step100", kind="sharded")
    """
    if format == "hf":
        from axon_nb.checkpoint.pretrained import save_pretrained

        return save_pretrained(cluster, path, name=name, overwrite=overwrite)
    if format != "torch":
        raise ValueError(
            f"format must be 'torch' (an axon_nb checkpoint: model, optimizer, step) or 'hf' "
            f"(save_pretrained: the model for from_pretrained), got {format!r}"
        )
    target = plan_save(path, kind, overwrite, private)
    target.create_partial()
    try:
        cluster.run(entry.save_checkpoint, name, target)
    except BaseException:
        target.discard_partial()  # kept only if complete: then the error says where it is
        raise
    return Checkpoint.read(target.path)


def load(cluster: ClusterLike, path: str | os.PathLike[str], *, name: str = "model") -> Checkpoint:
    """Load a checkpoint into training run ``name``; ``train(..., resume=True)`` continues.

    The run must exist, built with the checkpoint's model and optimizer (``steps=0`` builds
    one without training); any strategy and number of ranks works for a sharded
    checkpoint. Loading executes nothing from the checkpoint (tensors and plain values
    only; a tampered file is refused on every rank). A checkpoint that does not fit the run
    changes nothing. If a save replacing ``path`` died between its two renames, the complete
    checkpoint beside ``path`` is loaded, with a warning naming it. ``cluster.load(...)`` is
    the same call. Example::

        cluster.train(model=make_gpt, data=ds, strategy=FSDP(), steps=0)
        cluster.load("ckpt/step100")
        cluster.train(steps=100, batch_size=32, resume=True)
    """
    ckpt = Checkpoint.read(path)  # missing or incomplete: refused before any rank is asked
    cluster.run(entry.load_checkpoint, name, ckpt.path)
    return ckpt


def rescue(
    cluster: ClusterLike,
    path: str | os.PathLike[str],
    *,
    name: str = "model",
    private: bool = True,
) -> Checkpoint:
    """Save training run ``name`` from the ranks still alive after a rank died.

    No collective is used (the process group is broken): each survivor writes the pieces it
    holds, and one survivor puts them together into an ordinary full checkpoint, loadable
    with ``cluster.load`` after ``%axon_cluster --restart``. It works wherever the survivors
    together hold every element of the model: DDP, ZeRO-1 and ZeRO-2 parameters, and any
    replicated axis (a pipeline stage with a data-parallel twin). The optimizer state is kept
    where the survivors hold all of it too (DDP, replicated FSDP or pipeline layouts); where
    they do not, a warning says so and the checkpoint holds the model only. Where the model
    itself is incomplete (FSDP, tensor parallel or a pipeline stage whose only rank died),
    nothing is written and the error names the entries and rows the dead ranks held.

    Example::

        cluster.train(...)              # RankDiedError: rank 1 died while running
        cluster.rescue("ckpt/rescued")  # from the survivors
        %axon_cluster --restart
        cluster.train(..., steps=0); cluster.load("ckpt/rescued")
    """
    alive, dead = cluster.survivors()
    if not alive:
        raise RuntimeError("no rank is alive: nothing can be rescued. Restart the cluster")
    target = plan_save(path, "full", False, private)
    target.create_partial()
    try:
        cluster.control_call(entry.rescue_pieces, name, target.partial, ranks=alive)
        [done] = cluster.control_call(entry.rescue_assemble, name, target, dead, ranks=alive[:1])
    except BaseException:
        target.discard_partial()
        raise
    if done["optimizer_missing"]:
        warnings.warn(
            f"the rescued checkpoint {target.path} holds the model only, not the optimizer "
            f"state: {done['optimizer_missing']}. Training on from it starts the optimizer "
            "afresh",
            stacklevel=2,
        )
    return Checkpoint.read(target.path)
