"""``cluster.predict``: the outputs of the model the ranks hold for every item of a data set,
in data order, under its own layout (``axon_nb.rank.training.prediction``). Example::

    cluster.train(model=make_model, data=train_ds, loss=mse, steps=100, batch_size=32)
    out = cluster.predict(test_ds, batch_size=64)       # a CPU tensor [len(test_ds), ...]
    files = cluster.predict(big_ds, batch_size=64, output_dir="preds")   # paths only
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from axon_nb.rank import entry
from axon_nb.train import notebook_data
from axon_nb.train.progress import wait_with_bar

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike


def predict(
    cluster: ClusterLike,
    data: Any,
    *,
    batch_size: int,
    name: str = "model",
    output_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """Run ``name``'s model (trained, loaded or resumed) forward over every item of ``data``,
    without gradients and in eval mode, under its own strategy; return the outputs in data
    order as CPU tensors, in the structure the model returns (a tensor, a tuple, a dict or a
    transformers ``ModelOutput``; what has no rows is left out: values that are not
    tensors, such as a key-value cache, and scalars, such as a batch's loss).

    ``data``: a map-style dataset or a callable returning one; an item is an ``(input,
    target)`` pair (``model(input)``), a Mapping (``model(**item)``) or one input.

    Memory: rank 0 gathers the outputs and the kernel receives one copy of them. For outputs
    too large for that, ``output_dir`` (a directory every rank can write) makes each
    data-parallel replica write its rows to ``predictions-<i>-of-<dp>.pt`` (``{"indices",
    "outputs"}``; item ``k`` is in file ``k % dp`` at row ``k // dp``); the kernel then holds
    only the list of paths.
    """
    problems = []
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        problems.append(f"batch_size must be a positive integer, got {batch_size!r}")
    if data is None:
        problems.append("data is required: a dataset, or a callable returning one")
    if output_dir is not None:
        output_dir = os.path.abspath(os.fspath(output_dir))
        if not os.path.isdir(output_dir):
            problems.append(f"output_dir {output_dir!r} is not a directory: create it first")
    if problems:
        raise ValueError("; ".join(problems))
    data = notebook_data.share(cluster, data) or data  # its tensors held once per host
    sent = cluster.send(entry.predict, name, data, batch_size, output_dir)
    return wait_with_bar(sent, "predict")[0]
