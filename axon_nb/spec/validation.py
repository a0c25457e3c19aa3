"""The checks of a :class:`~axon_nb.spec.train_spec.TrainSpec`: its options one by one
(``problems``, every one listed at once) and against a world size (``check_world``).

Pure Python (no torch import), so the kernel checks a run before anything reaches the ranks.

Example::

    problems(spec)        # [] or what is wrong, each with what to do
    check_world(spec, 4)  # ValueError: batch_size=30 ... must be divisible by ...
"""

from __future__ import annotations

import builtins
import keyword
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from axon_nb.spec import eval_options, tracking_options
from axon_nb.spec.dask_rows import is_dask_data

if TYPE_CHECKING:
    from axon_nb.spec.train_spec import TrainSpec

LOSS_NORMALIZATIONS = ("mean", "tokens")
"""``loss_normalization=`` values: mean of micro-batch losses, or mean over target tokens."""

SCHEDULES = ("constant", "linear", "cosine")
"""Learning-rate shapes after warm-up: constant, linear decay to 0, cosine decay to 0."""

MIXED_PRECISION = (None, "bf16", "fp16")

NO_DECAY = ("bias_and_norm",)
"""``no_decay=`` values: which parameters train without weight decay."""

RANK_NAMES = ("rank", "world_size", "local_rank", "device")
"""Names every rank predefines in its namespace (``axon_nb.rank.world.bootstrap``)."""

MODULE_NAMES = ("torch", "dist", "nn", "F", "np", "os", "sys", "math", "time")
"""Names that ``%%axon`` cells commonly import modules as."""

LOADER_OPTIONS = (
    "num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "collate_fn",
    "worker_init_fn",
)  # fmt: skip
"""``loader=`` keys (``axon_nb.rank.data.shards`` passes them to each rank's DataLoader)."""


def check_world(spec: TrainSpec, world_size: int, ranks_per_host: int = 1) -> None:
    """Raise ``ValueError`` if the spec cannot run on ``world_size`` ranks: degrees that do
    not fit, a batch that does not split evenly over the data-parallel ranks, a pipeline
    without a loss or with micro-batches that do not divide its batch."""
    dims = spec.strategy.dims(world_size, ranks_per_host)
    config = spec.strategy.config()
    per_step = dims.dp * spec.grad_accum
    if spec.batch_size % per_step:
        lower = max(per_step, spec.batch_size // per_step * per_step)
        ranks = "world_size" if dims.dp == world_size else "data-parallel ranks"
        raise ValueError(
            f"batch_size={spec.batch_size} is the global batch per optimizer step; it must be "
            f"divisible by {ranks} x grad_accum = {dims.dp} x {spec.grad_accum} = "
            f"{per_step} so every rank gets equal micro-batches. Use e.g. batch_size={lower} "
            f"or {lower + per_step}"
        )
    if dims.pp > 1 and config.pipeline is not None:
        _check_pipeline(spec, dims.dp, config.pipeline.microbatches)


def _check_pipeline(spec: TrainSpec, dp: int, microbatches: int) -> None:
    if spec.loss_normalization != "mean":
        raise ValueError(
            "loss_normalization='tokens' is not available with a pipeline yet (its last stage "
            "computes each micro-batch's loss on its own): use loss_normalization='mean'"
        )
    if spec.loss is None and _first_item_is_pair(spec.data):
        raise ValueError(
            "a pipeline computes the loss on its last stage: pass loss=loss(output, target) "
            "(for axon_nb.models.GPT: loss=axon_nb.models.lm_loss), or give a transformers "
            "model Mapping items with labels (its own loss)"
        )
    micro = spec.batch_size // (dp * spec.grad_accum)
    if micro % microbatches:
        options = [m for m in range(1, micro + 1) if micro % m == 0]
        raise ValueError(
            f"microbatches={microbatches} must divide the {micro} samples each pipeline "
            f"runs per step (batch_size={spec.batch_size} / data-parallel ranks {dp} / "
            f"grad_accum={spec.grad_accum}); use one of {options}"
        )


def _first_item_is_pair(data: Any) -> bool:
    """Whether ``data`` (a dataset object; a callable is not looked into) holds pairs."""
    if callable(data) or not hasattr(data, "__getitem__"):
        return False
    try:
        item = data[0] if len(data) else None
    except Exception:  # the ranks will say what is wrong with it
        return False
    return isinstance(item, tuple | list) and len(item) == 2


def problems(spec: TrainSpec) -> list[str]:
    """Everything wrong with ``spec``'s options, each with what to do (``make_spec`` raises
    them together)::

        problems(spec)  # ["steps must be an integer >= 0, got -1", ...]
    """
    errors = []
    if spec.model is None and not spec.resume:
        errors.append(
            "model is required: an nn.Module, a callable returning one, or "
            "axon_nb.pretrained(cls, path)"
        )
    if spec.data is None and not spec.resume:
        errors.append("data is required: a Dataset of (input, target) or a callable returning one")
    if spec.columns is not None and not is_dask_data(spec.data):
        errors.append("columns= names a dask DataFrame's columns; data= is not one")
    if spec.loss is not None and not callable(spec.loss):
        errors.append(f"loss must be callable loss(output, target), got {spec.loss!r}")
    errors += _check_first_item(spec)
    errors += _check_param_groups(spec)
    if spec.loss_normalization not in LOSS_NORMALIZATIONS:
        errors.append(
            f"loss_normalization must be 'mean' or 'tokens' (mean over the labels that are not "
            f"-100), got {spec.loss_normalization!r}"
        )
    for name in ("steps", "batch_size", "grad_accum"):
        value = getattr(spec, name)
        least = 0 if name == "steps" else 1  # steps=0 builds the run without training
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            errors.append(f"{name} must be an integer >= {least}, got {value!r}")
    if spec.mixed_precision not in MIXED_PRECISION:
        errors.append(
            f"mixed_precision must be 'bf16', 'fp16' or None, got {spec.mixed_precision!r}"
        )
    staleness = getattr(spec.strategy, "staleness", None)  # (AsyncSGD's)
    if spec.mixed_precision == "fp16" and staleness:
        errors.append(
            "mixed_precision='fp16' cannot be used with AsyncSGD(staleness > 0): each step "
            "applies gradients scaled by an earlier step's loss scale; use 'bf16' (no scaler)"
        )
    errors += _check_loader(spec.loader)
    if not isinstance(spec.compile, bool):
        errors.append(f"compile must be True or False, got {spec.compile!r}")
    if spec.clip_grad_norm is not None and not spec.clip_grad_norm > 0:
        errors.append(f"clip_grad_norm must be > 0 or None, got {spec.clip_grad_norm!r}")
    if spec.schedule not in SCHEDULES:
        errors.append(f"schedule must be one of {', '.join(SCHEDULES)}, got {spec.schedule!r}")
    if not isinstance(spec.warmup_steps, int) or spec.warmup_steps < 0:
        errors.append(f"warmup_steps must be an integer >= 0, got {spec.warmup_steps!r}")
    if spec.scheduler is not None:
        if not callable(spec.scheduler):
            errors.append(
                f"scheduler must be a callable optimizer -> LRScheduler, got {spec.scheduler!r}"
            )
        elif spec.schedule != "constant" or spec.warmup_steps:
            errors.append(
                "scheduler= replaces schedule= and warmup_steps=: give the warm-up and shape "
                "in the scheduler, or leave scheduler=None"
            )
    name_error = _check_name(spec.name)
    if name_error:
        errors.append(name_error)
    if spec.metrics_interval_s < 0:
        errors.append(f"metrics_interval_s must be >= 0, got {spec.metrics_interval_s!r}")
    errors += eval_options.problems(spec.eval_data, spec.eval_every, spec.metrics)
    errors += tracking_options.problems(spec.log_to, spec.trace, spec.steps)
    return errors + _check_checkpoints(spec)


def _check_first_item(spec: TrainSpec) -> list[str]:
    """What can be told from a dataset object's first item here, before the ranks start: a
    Mapping item without ``labels`` gives the model no loss to return with ``loss=None``."""
    data = spec.data
    if spec.loss is not None or callable(data) or not hasattr(data, "__getitem__"):
        return []
    try:
        item = data[0] if len(data) else None
    except Exception:  # the ranks will say what is wrong with it
        return []
    if isinstance(item, Mapping) and "labels" not in item and "label" not in item:
        return [
            f"loss=None takes the model's own loss, which a model only computes when the batch "
            f"has labels; the items have keys {sorted(map(str, item))} and no 'labels': add "
            "labels to each item, or pass loss=fn(output, batch)"
        ]
    return []


def _check_param_groups(spec: TrainSpec) -> list[str]:
    """``param_groups`` and ``no_decay``; with a model object here (not a callable that builds
    one on the ranks), also what the rule gives each trainable parameter."""
    errors = []
    if spec.no_decay is not None and spec.no_decay not in NO_DECAY:
        errors.append(
            f"no_decay must be {' or '.join(map(repr, NO_DECAY))} (no weight decay for biases "
            f"and normalisation weights) or None, got {spec.no_decay!r}"
        )
    rule = spec.param_groups
    if rule is not None and not callable(rule):
        errors.append(
            "param_groups must be a callable (name, parameter) -> options such as "
            f"{{'weight_decay': 0.0}} (or None), got {rule!r}"
        )
        return errors
    named = getattr(spec.model, "named_parameters", None)
    if not callable(named) or isinstance(spec.model, type):  # built on the ranks: checked there
        return errors
    trainable = [(n, p) for n, p in named() if getattr(p, "requires_grad", True)]
    if not trainable:
        errors.append(
            "every parameter of the model has requires_grad=False: there is nothing to train; "
            "unfreeze some (e.g. peft's get_peft_model adds trainable adapters)"
        )
    if rule is None:
        return errors
    for name, param in trainable:
        problem = group_options_problem(name, rule, param)
        if problem:
            return [*errors, problem]
    return errors


def group_options_problem(name: str, rule: Callable[..., Any], param: Any) -> str | None:
    """Why ``rule(name, param)`` is not a parameter's group options, or None if it is: a
    Mapping (or None) of optimizer settings by name, without ``params``::

        group_options_problem("head.bias", lambda n, p: {"weight_decay": 0.0}, p)  # None
    """
    try:
        options = rule(name, param)
    except Exception as e:
        return f"param_groups raised {type(e).__name__}: {e} for the parameter {name!r}"
    if options is None:
        return None
    if not isinstance(options, Mapping):
        return (
            f"param_groups must return a dict of optimizer settings (or None) for each "
            f"parameter; for {name!r} it returned {type(options).__name__} {options!r}"
        )
    keys = [k for k in options if not isinstance(k, str) or k == "params"]
    if keys:
        return (
            f"param_groups returned {keys} for {name!r}: give optimizer settings by name "
            "(e.g. {'lr': 1e-4, 'weight_decay': 0.0}); the parameters are grouped for you"
        )
    return None


def _check_loader(loader: Any) -> list[str]:
    if loader is None:
        return []
    if not isinstance(loader, dict):
        return [f"loader must be a dict of DataLoader options, got {loader!r}"]
    errors = []
    unknown = sorted(set(loader) - set(LOADER_OPTIONS))
    if unknown:
        errors.append(f"loader has unknown option(s) {unknown}; use {', '.join(LOADER_OPTIONS)}")
    workers = loader.get("num_workers", 0)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        errors.append(f"loader num_workers must be an integer >= 0, got {workers!r}")
    elif not workers:
        needs = [k for k in ("prefetch_factor", "persistent_workers") if loader.get(k)]
        if needs:
            errors.append(f"loader {' and '.join(needs)} need num_workers >= 1 (worker processes)")
    factor = loader.get("prefetch_factor")
    if factor is not None and (
        isinstance(factor, bool) or not isinstance(factor, int) or factor < 1
    ):
        errors.append(f"loader prefetch_factor must be an integer >= 1, got {factor!r}")
    for flag in ("pin_memory", "persistent_workers"):
        if flag in loader and not isinstance(loader[flag], bool):
            errors.append(f"loader {flag} must be True or False, got {loader[flag]!r}")
    for fn in ("collate_fn", "worker_init_fn"):
        if loader.get(fn) is not None and not callable(loader[fn]):
            errors.append(
                f"loader {fn} must be callable (e.g. transformers' DataCollatorWithPadding"
                f"(tokenizer) for collate_fn), got {loader[fn]!r}"
            )
    return errors


def _check_checkpoints(spec: TrainSpec) -> list[str]:
    """Periodic checkpoints and restarts: each option with the others it needs."""
    errors = []
    every, seconds = spec.checkpoint_every, spec.checkpoint_every_s
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        errors.append(f"checkpoint_every must be an integer >= 1 (steps), got {every!r}")
    if seconds is not None and not (isinstance(seconds, int | float) and seconds > 0):
        errors.append(f"checkpoint_every_s must be a number of seconds > 0, got {seconds!r}")
    if spec.keep is not None and (not isinstance(spec.keep, int) or spec.keep < 1):
        errors.append(f"keep must be an integer >= 1 (checkpoints kept), got {spec.keep!r}")
    if not isinstance(spec.max_restarts, int) or spec.max_restarts < 0:
        errors.append(f"max_restarts must be an integer >= 0, got {spec.max_restarts!r}")
    if spec.max_restarts and (spec.model is None or spec.data is None):
        errors.append(
            "max_restarts rebuilds the run on fresh ranks: pass model= and data= (also with "
            "resume=True)"
        )
    if spec.min_ranks is not None:
        if (
            isinstance(spec.min_ranks, bool)
            or not isinstance(spec.min_ranks, int)
            or spec.min_ranks < 1
        ):
            errors.append(f"min_ranks must be an integer >= 1, got {spec.min_ranks!r}")
        elif not spec.max_restarts:
            errors.append(
                "min_ranks needs max_restarts >= 1: it says how far a restart may shrink the world"
            )
    if spec.checkpoint_dir is None:
        needs = [n for n in ("checkpoint_every", "checkpoint_every_s", "keep") if getattr(spec, n)]
        if spec.max_restarts:
            needs.append("max_restarts (it resumes from the newest checkpoint)")
        if needs:
            errors.append(
                f"{', '.join(needs)} need checkpoint_dir=: the directory periodic checkpoints "
                "go to, e.g. checkpoint_dir='ckpt/run1'"
            )
    elif every is None and seconds is None:
        errors.append(
            "checkpoint_dir= needs checkpoint_every= (steps) and/or checkpoint_every_s= "
            "(seconds): how often to take a checkpoint"
        )
    return errors


def _check_name(name: Any) -> str | None:
    """Why ``name`` cannot be a run's variable on the ranks, or None if it can.

    It must be an identifier that shadows nothing a ``%%axon`` cell relies on::

        _check_name("model")  # None
        _check_name("rank")   # "name='rank' would replace the rank's own number ..."
    """
    hint = 'choose another name, e.g. name="model" or name="gpt"'
    if not isinstance(name, str) or not name.isidentifier():
        return f"name must be a Python identifier (a variable on the ranks), got {name!r}"
    if keyword.iskeyword(name):
        return f"name={name!r} is a Python keyword and cannot be a variable; {hint}"
    if name in RANK_NAMES:
        return (
            f"name={name!r} would replace the ranks' predefined {name!r} (each rank defines "
            f"{', '.join(RANK_NAMES)} for %%axon cells); {hint}"
        )
    if name in MODULE_NAMES:
        return (
            f"name={name!r} would shadow the module cells usually import as {name!r} "
            f"({', '.join(MODULE_NAMES)} are kept free); {hint}"
        )
    if name in dir(builtins) or name in ("get_ipython", "display"):  # IPython's builtins
        return f"name={name!r} would shadow the Python builtin {name!r} on the ranks; {hint}"
    return None
