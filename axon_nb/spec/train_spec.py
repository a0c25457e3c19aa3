"""``TrainSpec``: everything one training run needs, checked once on the kernel, sent to the ranks.

The options are declared here, once; the public entry points (``Cluster.train``,
``Cluster.compare``, ``train_local``) take them by name and build the spec with
:func:`make_spec`, and every layer below takes the spec. The checks are in
``axon_nb.spec.validation``. Pure Python (no torch import), so the kernel can build and
validate it without touching CUDA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from axon_nb.strategies import Strategy

OPTIMIZERS = {
    "sgd": "SGD",
    "adam": "Adam",
    "adamw": "AdamW",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop",
    "adamax": "Adamax",
    "nadam": "NAdam",
    "radam": "RAdam",
}
"""Optimizer names accepted in ``optimizer=("name", {...})`` -> ``torch.optim`` class names."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    """One training run, as the ranks receive it."""

    model: Any
    """``nn.Module`` or a zero-argument callable returning one (called on every rank); or
    ``axon_nb.pretrained(cls, path)``: built with its parameters on the meta device, laid
    out, and then each rank reads only its own part of the safetensors weights
    (``axon_nb.spec.pretrained_model``), so a host holds about one copy of them."""
    data: Any
    """``torch.utils.data.Dataset`` of ``(input, target)`` items, or a callable returning one;
    or a dask DataFrame (with ``columns``), a pair of dask Arrays or a Bag (laid out over the
    ranks' workers as ``DaskShards`` before the ranks receive the spec)."""
    strategy: Strategy
    """How the model is parallelized across the ranks."""
    columns: tuple[Any, Any] | None = None
    """For a dask DataFrame as ``data``: ``(feature columns, target column or columns)``."""
    optimizer: tuple[str, dict[str, Any]] | Callable[..., Any]
    """``(name, kwargs)`` for a ``torch.optim`` optimizer, or ``params -> Optimizer`` (given
    the trainable parameters, or their groups as ``[{"params": [...], **options}, ...]`` with
    ``param_groups`` or ``no_decay``), under every strategy."""
    param_groups: Callable[[str, Any], Mapping[str, Any] | None] | None = None
    """``(name, parameter) -> options`` for each trainable parameter, e.g. ``{"lr": 1e-4}`` or
    ``{"weight_decay": 0.0}`` (None or ``{}``: the optimizer's own settings). Parameters with
    equal options share one optimizer parameter group; names are the user's model's, decided
    once before any strategy wraps or shards it (``axon_nb.parallel.param_groups``)."""
    no_decay: str | None = None
    """``"bias_and_norm"``: no weight decay for biases and the weights of normalisation layers
    (``LayerNorm``, ``RMSNorm``, ``BatchNorm``, ... by class name), as transformer recipes
    train; ``param_groups`` options override it. None: every parameter decays alike."""
    loss: Callable[..., Any] | None = None
    """``loss(output, target) -> scalar`` (for Mapping batches ``loss(output, batch)``); None:
    the model's own loss, ``model(input, target)`` for pairs, ``model(**batch).loss`` for
    Mapping batches (``axon_nb.rank.training.model_loss``)."""
    loss_normalization: str = "mean"
    """``"mean"``: the step loss is the mean of the micro-batch losses. ``"tokens"``: the mean
    over every target token of the global batch that is not ``-100`` (padding, prompts), like
    the Hugging Face Trainer's ``num_items_in_batch``, so padded variable-length batches give
    the same loss however they are split over ranks and micro-batches."""
    steps: int
    """Optimizer steps to run in this call."""
    batch_size: int
    """Global samples per optimizer step (split over ranks, then over ``grad_accum``)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    mixed_precision: str | None = None
    """``"bf16"`` (autocast), ``"fp16"`` (autocast + grad scaler) or None (fp32)."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm to this value before each optimizer step."""
    loader: dict[str, Any] | None = None
    """Options of each rank's DataLoader: ``num_workers``, ``pin_memory`` (default: on GPU
    ranks), ``prefetch_factor``, ``persistent_workers``, ``collate_fn`` (e.g. transformers'
    ``DataCollatorWithPadding(tokenizer)``; default: PyTorch's, lists of numbers made
    tensors), ``worker_init_fn`` (e.g. to seed augmentations in worker processes)."""
    compile: bool = False
    """``torch.compile`` the model's blocks (each entry of its ``nn.ModuleList``), or the whole
    model when it has none, before it is sharded (``axon_nb.parallel.compile``)."""
    schedule: str = "constant"
    """Learning-rate shape after warm-up: ``constant``, ``linear`` or ``cosine`` (to 0)."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0."""
    scheduler: Callable[..., Any] | None = None
    """``optimizer -> LRScheduler``, stepped after every optimizer step, in place of
    ``schedule`` and ``warmup_steps``; e.g. ``lambda opt: get_cosine_schedule_with_warmup(opt,
    10, 500)`` (transformers) or ``lambda opt: OneCycleLR(opt, 0.01, total_steps=500)``."""
    seed: int = 0
    """Seed for model initialisation (same on every rank) and data order."""
    resume: bool = False
    """Continue the run named ``name`` already on the ranks (model, optimizer, step)."""
    name: str = "model"
    """Variable name of the trained model in the ranks' namespace (``%%axon`` cells)."""
    metrics_interval_s: float = 0.5
    """Seconds between metrics publications from each rank (0 disables streaming)."""
    checkpoint_dir: str | None = None
    """Directory of periodic checkpoints (``step-00000050``, ...); None: none are taken."""
    checkpoint_every: int | None = None
    """With ``checkpoint_dir``: take a checkpoint every this many steps."""
    checkpoint_every_s: float | None = None
    """With ``checkpoint_dir``: take one when this many seconds passed since the last."""
    keep: int | None = None
    """Keep only the newest ``keep`` complete periodic checkpoints (None: keep all)."""
    max_restarts: int = 0
    """When a rank dies, restart the ranks and resume from the newest checkpoint in
    ``checkpoint_dir``, at most this many times."""
    min_ranks: int | None = None
    """With ``max_restarts``: when the ranks cannot all come back (the restart fails, or the
    same rank dies again in the restarted run), go on with fewer ranks, down to this many,
    resharding the checkpoint (elastic). None: always restart the same number."""
    eval_data: Any = None
    """A map-style dataset (or a callable returning one) evaluated under the run's strategy
    every ``eval_every`` steps and at the call's last step: ``result.evals``
    (``axon_nb.spec.eval_options``)."""
    eval_every: int | None = None
    """With ``eval_data``: evaluate every this many steps (None: only at the last step)."""
    metrics: Mapping[str, Callable[..., Any]] | None = None
    """With ``eval_data``: ``{"name": fn(output, target_or_batch) -> scalar}``, each a batch's
    mean, reported as the sample-weighted mean over the whole evaluation set."""
    log_to: tuple[str, ...] | None = None
    """Experiment trackers the kernel writes the run's scalars to once per step:
    ``"tensorboard"`` and/or ``"mlflow"`` (``axon_nb.spec.tracking_options``)."""
    log_dir: str | None = None
    """With ``log_to``: where TensorBoard events (and MLflow's store, unless
    ``MLFLOW_TRACKING_URI`` is set) go; default ``runs/<name>``."""
    trace: tuple[int, int] | None = None
    """``(start_step, steps)``: ``torch.profiler`` traces every rank for ``steps`` steps from
    the call's step ``start_step`` (the first is 1): one trace per rank in
    ``result.trace_dir``."""

    @property
    def optimizer_kwargs(self) -> dict[str, Any]:
        return dict(self.optimizer[1]) if isinstance(self.optimizer, tuple) else {}

    @property
    def streams(self) -> bool:
        """The ranks publish metrics as they go (``metrics_interval_s > 0``): a stop can see
        when they began (``train/training_begun.py``)."""
        return self.metrics_interval_s > 0


CALLER_DEFAULTS = {"model": None, "data": None, "strategy": None, "optimizer": None}
"""Options the spec requires but every function that takes them defaults to None:
``make_spec`` fills them in (the strategy's default, AdamW, a run resumed by name)."""

CLUSTER_ONLY = ("metrics_interval_s", "checkpoint_dir", "checkpoint_every",
                "checkpoint_every_s", "keep", "max_restarts", "min_ranks",
                "log_to", "log_dir", "trace")  # fmt: skip
"""Options of a run on a cluster that ``train_local`` (one process) does not take."""

COMPARE_SETS = ("strategy", "resume", "name", *CLUSTER_ONLY[1:], "eval_data", "eval_every",
                "metrics")  # fmt: skip
"""Options ``compare`` sets itself for every candidate (it streams metrics, so it takes
``metrics_interval_s``; it measures training steps, so it evaluates nothing)."""

ADVISE_OPTIONS = ("batch_size", "optimizer", "mixed_precision")
"""The training options the advisor's predictions depend on (``batch_size`` may be left out
there: 4 samples per rank)."""


def entry_point_options() -> dict[str, dict[str, Any]]:
    """The public functions that take training options one by one, and the options (name ->
    default, or ``REQUIRED``) each must take: the single declaration that
    ``tests/test_signatures.py`` checks ``Cluster.train``, ``train_local``,
    ``Cluster.compare`` and ``advise`` against, so a new option cannot be forgotten in one of
    them. Every function below them takes the built :class:`TrainSpec` instead."""
    everything = {
        f.name: CALLER_DEFAULTS.get(
            f.name, f.default if f.default is not dataclasses.MISSING else REQUIRED
        )
        for f in dataclasses.fields(TrainSpec)
    }
    return {
        "train": everything,
        "train_local": {k: v for k, v in everything.items() if k not in CLUSTER_ONLY},
        # (a comparison trains a few steps of each candidate)
        "compare": {k: v for k, v in everything.items() if k not in COMPARE_SETS} | {"steps": 10},
        "advise": {k: everything[k] for k in ADVISE_OPTIONS},
    }


REQUIRED = object()
"""Marks an option that has no default."""


def spec_options(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The training options among a public function's arguments (its ``locals()``), for
    :func:`make_spec`; the function's other arguments (``self``, ``block``, ``device``) are
    left out::

        spec = make_spec(DDP, **spec_options(locals()))
    """
    fields = {f.name for f in dataclasses.fields(TrainSpec)}
    return {k: v for k, v in arguments.items() if k in fields}
