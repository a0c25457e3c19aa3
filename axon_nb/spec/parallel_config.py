"""``ParallelConfig``: the options ``parallelize`` honours, one typed group per technique.

Strategies (``axon_nb.strategies``) are what users write; each maps to a ``ParallelDims`` and
one of these. Pure Python, like ``dims.py``: strategies check their options with the
``problems()`` methods here, in the kernel, before anything is sent to the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from axon_nb.spec.parallel_dims import positive

DATA_PARALLEL = ("none", "ddp", "fsdp", "zero1", "zero2")
"""How the data-parallel axes hold the model: not at all, replicated (DDP), sharded (FSDP),
or whole with sharded optimizer state (ZeRO-1) and gradients too (ZeRO-2)."""
COMM_HOOKS = (None, "fp16", "bf16", "powersgd")
DTYPES = (None, "bf16", "fp16", "fp32")
TP_STYLES = (
    "colwise", "rowwise", "colwise_rep", "rowwise_rep", "colwise_gather_output",
    "embedding_rowwise", "embedding_colwise",
)  # fmt: skip
"""Tensor-parallel style names in plans (``axon_nb.parallel.tensor`` says what each does); the
names transformers' ``base_model_tp_plan`` uses."""
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True, kw_only=True, slots=True)
class DDPConfig:
    """``DistributedDataParallel`` over the data-parallel ranks (also ZeRO-1's gradients)."""

    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB (DDP's ``bucket_cap_mb``)."""
    find_unused_parameters: bool = False
    """Allow parameters that get no gradient in some steps (costs a graph walk per step)."""
    static_graph: bool = False
    """Promise the set of used parameters never changes (enables DDP's static-graph tricks)."""
    comm_hook: str | None = None
    """Gradient compression: None (fp32 all-reduce), ``"fp16"``, ``"bf16"`` or ``"powersgd"``."""
    powersgd_rank: int = 1
    """Rank of PowerSGD's low-rank approximation (higher is more accurate, more bytes)."""
    powersgd_start_step: int = 10
    """Steps of plain all-reduce before PowerSGD starts compressing (PowerSGD's warm start)."""
    gradient_as_bucket_view: bool = True
    """Gradients are views into DDP's communication buckets, so they exist once, not twice
    (DDP's ``gradient_as_bucket_view``); ``False`` keeps a separate copy."""

    def problems(self) -> list[str]:
        errors = []
        if self.comm_hook not in COMM_HOOKS:
            errors.append(
                f"comm_hook must be None, 'fp16', 'bf16' or 'powersgd', got {self.comm_hook!r}"
            )
        if not _number(self.bucket_cap_mb) or not self.bucket_cap_mb > 0:
            errors.append(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")
        for option in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view"):
            if not isinstance(getattr(self, option), bool):
                errors.append(f"{option} must be True or False, got {getattr(self, option)!r}")
        if not positive(self.powersgd_rank):
            errors.append(f"powersgd_rank must be an integer >= 1, got {self.powersgd_rank!r}")
        if not positive(self.powersgd_start_step) or self.powersgd_start_step < 2:
            errors.append(
                f"powersgd_start_step must be an integer >= 2 (PowerSGD needs plain all-reduce "
                f"steps first), got {self.powersgd_start_step!r}"
            )
        return errors


@dataclass(frozen=True, kw_only=True, slots=True)
class FSDPConfig:
    """FSDP2 ``fully_shard`` over the data-parallel ranks (2-D mesh for hybrid sharding)."""

    reshard_after_forward: bool = True
    """Free gathered parameters after forward (regather in backward)."""
    param_dtype: str | None = None
    """Compute dtype of gathered parameters, or None (as stored)."""
    reduce_dtype: str | None = None
    """Dtype of gradient reduction, or None (the parameter dtype)."""
    cpu_offload: bool = False
    """Keep shards on the CPU between uses (GPU ranks)."""
    auto_wrap: tuple[str, ...] | None = None
    """Class names of the submodules sharded as their own units."""
    min_params: int | None = None
    """Instead of classes: leaf modules with at least this many parameters become units."""

    def problems(self) -> list[str]:
        errors = []
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value not in DTYPES:
                errors.append(f"{name} must be 'bf16', 'fp16', 'fp32' or None, got {value!r}")
        if self.min_params is not None and not positive(self.min_params):
            errors.append(f"min_params must be a positive integer, got {self.min_params!r}")
        return errors


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorConfig:
    """Tensor parallelism over the ``tp`` axis."""

    plan: dict[str, Any] | str | None = None
    """Module-name pattern -> a style of :data:`TP_STYLES` or a torch ``ParallelStyle``
    object; ``"auto"``: the model's own plan (a transformers model's ``base_model_tp_plan``);
    None: the default plan."""
    sequence_parallel: bool = False
    """Shard norms (and the residual stream) along the sequence between parallel layers."""

    def problems(self) -> list[str]:
        if self.plan is None or self.plan == "auto":
            return []
        usage = (
            f"plan maps module-name patterns to one of {', '.join(TP_STYLES)} or a torch "
            "ParallelStyle (e.g. ColwiseParallel()), or is 'auto' (the model's own plan)"
        )
        if not isinstance(self.plan, dict):
            return [f"{usage}; got {self.plan!r}"]
        bad = {k: v for k, v in self.plan.items() if not is_tp_style(v)}
        return [f"{usage}; got {bad!r}"] if bad else []


def is_tp_style(value: Any) -> bool:
    """A style name of :data:`TP_STYLES`, or an object that looks like a torch
    ``ParallelStyle`` (it has ``_apply``; checked for real on the ranks)."""
    if isinstance(value, str):
        return value in TP_STYLES
    return callable(getattr(value, "_apply", None))


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    """Pipeline stages over the ``pp`` axis."""

    microbatches: int = 4
    """Micro-batches each step's batch is split into (more: a smaller bubble)."""
    schedule: str = "1f1b"
    """``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``."""
    virtual_stages: int = 1
    """Stages per rank (``interleaved_1f1b`` needs at least 2)."""
    split_points: tuple[int, ...] | None = None
    """First layer index of every stage after the first, instead of balancing."""
    split: tuple[str, ...] | None = None
    """Module names the model is cut into, in forward order, instead of its own plan (a
    ``ModuleList`` gives one layer per entry): ``("model.embed_tokens", "model.layers",
    "model.norm", "lm_head")``."""

    def problems(self) -> list[str]:
        errors = []
        if self.split is not None and (
            isinstance(self.split, str)
            or not self.split
            or not all(isinstance(n, str) and n for n in self.split)
        ):
            errors.append(
                "split must be a tuple of module names in forward order, e.g. ('model."
                f"embed_tokens', 'model.layers', 'model.norm', 'lm_head'); got {self.split!r}"
            )
        if self.schedule not in SCHEDULES:
            errors.append(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not positive(self.microbatches):
            errors.append(f"microbatches must be a positive integer, got {self.microbatches!r}")
        if not positive(self.virtual_stages):
            errors.append(f"virtual_stages must be a positive integer, got {self.virtual_stages!r}")
        elif self.schedule == "interleaved_1f1b" and self.virtual_stages < 2:
            errors.append(
                "schedule='interleaved_1f1b' interleaves several stages per rank: pass "
                "virtual_stages >= 2 (or use schedule='1f1b' for one stage per rank)"
            )
        elif self.schedule != "interleaved_1f1b" and self.virtual_stages != 1:
            errors.append(
                f"virtual_stages={self.virtual_stages} needs schedule='interleaved_1f1b'; "
                f"{self.schedule!r} runs one stage per rank"
            )
        return errors


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertConfig:
    """Expert parallelism over the ``ep`` axis (``axon_nb.parallel.expert``)."""

    plan: tuple[str, ...] | None = None
    """Module-name patterns of the experts modules; None: the model's own (a transformers
    model's ``base_model_ep_plan``, else every module with ``[num_experts, ...]`` weights)."""

    def problems(self) -> list[str]:
        plan = self.plan
        if plan is None:
            return []
        if isinstance(plan, str) or not plan or not all(isinstance(p, str) and p for p in plan):
            return [
                "plan must be a tuple of module-name patterns of the experts modules, e.g. "
                f"('model.layers.*.mlp.experts',), or None (the model's own); got {plan!r}"
            ]
        return []


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalSGDConfig:
    """Post-local SGD on DDP: gradients all-reduced for ``warmup_steps``, then each rank
    steps on its own gradients and the parameters are averaged every ``period`` steps."""

    period: int = 4
    """Steps between parameter averages (1: every step)."""
    warmup_steps: int = 0
    """Steps of ordinary DDP (gradients all-reduced) before local steps start."""

    def problems(self) -> list[str]:
        errors = []
        if not positive(self.period):
            errors.append(f"period must be an integer >= 1 (steps), got {self.period!r}")
        if (
            not isinstance(self.warmup_steps, int)
            or isinstance(self.warmup_steps, bool)
            or self.warmup_steps < 0
        ):
            errors.append(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        return errors


COMPRESSIONS = (None, "bf16", "int8")


@dataclass(frozen=True, kw_only=True, slots=True)
class DiLoCoConfig:
    """DiLoCo on DDP: ``inner_steps`` steps of the inner optimizer on each rank's own
    gradients, then the outer gradient (the mean over ranks of global minus local parameters)
    applied by an outer SGD; see ``parallel/diloco.py``."""

    inner_steps: int = 100
    """Inner steps between outer steps (the paper's H)."""
    outer_lr: float = 0.7
    """The outer SGD's learning rate."""
    outer_momentum: float = 0.9
    """The outer SGD's momentum."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD."""
    compress: str | None = None
    """How the outer gradients travel: None (fp32), ``"bf16"`` or ``"int8"``."""
    shard_size: int = 1
    """Ranks per worker: above 1, each worker is a group of ranks that shards its model with
    FSDP, and each rank's outer all-reduce is of its shard, with the other workers' same one."""

    def problems(self) -> list[str]:
        errors = []
        if not positive(self.inner_steps):
            errors.append(f"inner_steps must be an integer >= 1 (steps), got {self.inner_steps!r}")
        if not _number(self.outer_lr) or self.outer_lr <= 0:
            errors.append(f"outer_lr must be a number > 0, got {self.outer_lr!r}")
        if not _number(self.outer_momentum) or not 0 <= self.outer_momentum < 1:
            errors.append(f"outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        if not isinstance(self.nesterov, bool):
            errors.append(f"nesterov must be True or False, got {self.nesterov!r}")
        if self.compress not in COMPRESSIONS:
            errors.append(f"compress must be None, 'bf16' or 'int8', got {self.compress!r}")
        if not positive(self.shard_size):
            errors.append(f"shard_size must be an integer >= 1 (ranks), got {self.shard_size!r}")
        return errors


@dataclass(frozen=True, kw_only=True, slots=True)
class AsyncSGDConfig:
    """AsyncSGD on DDP: each step applies the mean gradient of ``staleness`` steps ago, whose
    all-reduce ran in the background meanwhile; see ``parallel/async_sgd.py``."""

    staleness: int = 4
    """How many steps a rank may run ahead of the slowest (0: DDP)."""

    def problems(self) -> list[str]:
        staleness = self.staleness
        if isinstance(staleness, int) and not isinstance(staleness, bool) and staleness >= 0:
            return []
        return [f"staleness must be an integer >= 0 (steps), got {self.staleness!r}"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """Everything ``parallelize`` applies besides the degrees (see ``parallelize.py``)."""

    data_parallel: str = "none"
    """One of :data:`DATA_PARALLEL`."""
    ddp: DDPConfig | None = None
    """Options of ``data_parallel="ddp"`` and ``"zero1"``."""
    fsdp: FSDPConfig | None = None
    """Options of ``data_parallel="fsdp"``."""
    bucket_cap_mb: float = 25.0
    """ZeRO-2's gradient bucket size in MiB."""
    tensor: TensorConfig | None = None
    """Options of tensor parallelism (used when ``tp > 1``)."""
    pipeline: PipelineConfig | None = None
    """Options of the pipeline (used when ``pp > 1``)."""
    expert: ExpertConfig | None = None
    """Options of expert parallelism (used when ``ep > 1``)."""
    activation_checkpointing: int = 0
    """Recompute every n-th block's activations in backward; 0: off."""
    local_sgd: LocalSGDConfig | None = None
    """With ``data_parallel="ddp"``: post-local SGD instead of an all-reduce every step."""
    diloco: DiLoCoConfig | None = None
    """With ``data_parallel="ddp"``: DiLoCo's outer steps instead of an all-reduce every step."""
    async_sgd: AsyncSGDConfig | None = None
    """With ``data_parallel="ddp"``: each step applies the gradients of ``staleness`` steps ago."""

    @property
    def lag(self) -> int:
        """How many steps behind a rank may read the per-step agreement (``agreement.py``):
        1, or AsyncSGD's staleness (so its ranks are held no closer than that)."""
        return max(1, self.async_sgd.staleness) if self.async_sgd is not None else 1


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
