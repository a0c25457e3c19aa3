"""``cluster.evaluate``: the loss and metrics of the model the ranks hold, over a data set,
under the run's own layout (``axon_nb.rank.training.evaluation``). Example::

    cluster.train(model=make_model, data=train_ds, loss=mse, steps=100, batch_size=32)
    cluster.evaluate(test_ds, loss=mse, metrics={"mae": mae}, batch_size=64)
    # {'loss': 0.031, 'mae': 0.14, 'samples': 1000}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from axon_nb.rank import entry
from axon_nb.train import notebook_data
from axon_nb.train.progress import wait_with_bar

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike


def evaluate(
    cluster: ClusterLike,
    data: Any,
    *,
    loss: Callable[..., Any] | None = None,
    metrics: Mapping[str, Callable[..., Any]] | None = None,
    batch_size: int,
    name: str = "model",
) -> dict[str, float]:
    """The sample-weighted mean loss and ``metrics`` over every sample of ``data`` (each
    counted once), of training run ``name``'s model (trained, loaded or resumed), under its
    own strategy: ``{"loss": ..., <metric>: ..., "samples": N}``.

    ``data``: a map-style dataset or a callable returning one, of ``(input, target)`` pairs
    (then ``loss(output, target)`` is required) or Mappings (``model(**batch)``; ``loss=None``
    takes the model's own loss). A metric is ``fn(output, target_or_batch) -> scalar``, a
    batch's mean. The model runs in eval mode without gradients; its mode is restored.
    """
    problems = []
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        problems.append(f"batch_size must be a positive integer, got {batch_size!r}")
    if loss is not None and not callable(loss):
        problems.append(f"loss must be callable loss(output, target) or None, got {loss!r}")
    metrics = dict(metrics or {})
    bad = [k for k, fn in metrics.items() if not isinstance(k, str) or not callable(fn)]
    if bad:
        problems.append(
            f"metrics must map names to callables fn(output, target) -> scalar; {bad} do not"
        )
    if "loss" in metrics or "samples" in metrics:
        problems.append("metrics cannot be named 'loss' or 'samples' (the result's own keys)")
    if data is None:
        problems.append("data is required: a dataset, or a callable returning one")
    if problems:
        raise ValueError("; ".join(problems))
    data = notebook_data.share(cluster, data) or data  # its tensors held once per host
    sent = cluster.send(entry.evaluate, name, data, loss, metrics, batch_size)
    return wait_with_bar(sent, "evaluate")[0]
