"""``Pipeline``: pipeline parallelism (``torch.distributed.pipelining``) over all ranks."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from axon_nb.strategies.base import MicroStep, Strategy

if TYPE_CHECKING:
    import torch
    from torch import nn

    from axon_nb.engine.runtime import RankContext

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True, kw_only=True, slots=True)
class Pipeline(Strategy):
    """Cut the model into stages, one per rank (or ``virtual_stages`` per rank), and run
    micro-batches through them with a pipeline schedule.

    - ``schedule``: ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (one forward,
      one backward: fewer activations alive) or ``"interleaved_1f1b"`` (``virtual_stages``
      stages per rank, a smaller bubble).
    - Stages are cut from an ``nn.Sequential``'s children or a model's ``pipeline_layers()``,
      balanced by parameter count, or at ``split_points`` (the first layer of each stage after
      the first). For explicit stage modules, pass ``nn.Sequential(stage0, stage1, ...)`` with
      one stage per child.
    - The loss (``loss=`` of ``train``, required) is computed on the last stage; the global loss
      is its mean. Each rank holds only its stages' parameters.

    Example::

        from axon_nb import Pipeline
        from axon_nb.models import GPT, lm_loss
        cluster.train(model=GPT, data=ds, loss=lm_loss, steps=100, batch_size=32,
                      strategy=Pipeline(microbatches=8, schedule="1f1b"))
    """

    name: ClassVar[str] = "pipeline"

    num_stages: int | None = None
    """Total stages; it must be ranks x ``virtual_stages`` (the default)."""
    microbatches: int = 4
    """Micro-batches each step's batch is split into (more: a smaller bubble)."""
    schedule: str = "1f1b"
    """``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``."""
    virtual_stages: int = 1
    """Stages per rank (``interleaved_1f1b`` needs at least 2)."""
    split_points: tuple[int, ...] | None = None
    """First layer index of every stage after the first, instead of balancing."""

    def __post_init__(self) -> None:
        errors = []
        if self.schedule not in SCHEDULES:
            errors.append(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not _positive(self.microbatches):
            errors.append(f"microbatches must be a positive integer, got {self.microbatches!r}")
        if not _positive(self.virtual_stages):
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
        if errors:
            raise ValueError("invalid Pipeline options:\n  - " + "\n  - ".join(errors))

    # The pipeline spans all ranks here; Hybrid reuses these methods with its own degrees.
    def _degrees(self, world_size: int) -> Any:
        from axon_nb.parallel.dims import ParallelDims

        return ParallelDims(dp=1, tp=1, pp=world_size, world_size=world_size)

    def check_world(self, world_size: int) -> None:
        expected = world_size * self.virtual_stages
        if self.num_stages is not None and self.num_stages != expected:
            ranks = max(1, self.num_stages // self.virtual_stages)
            raise ValueError(
                f"Pipeline(num_stages={self.num_stages}) on {world_size} ranks with "
                f"virtual_stages={self.virtual_stages}: each rank runs virtual_stages stages, so "
                f"num_stages must be {expected}. Start {ranks} ranks, or change virtual_stages"
            )

    def check_spec(self, spec: Any, world_size: int) -> None:
        if spec.loss is None:
            raise ValueError(
                "a pipeline computes the loss on its last stage: pass loss=loss(output, target) "
                "(for axon_nb.models.GPT: loss=axon_nb.models.lm_loss)"
            )
        if spec.mixed_precision == "fp16":
            raise ValueError(
                "fp16 needs a gradient scaler, which pipeline schedules do not support: use "
                "mixed_precision='bf16'"
            )
        dims = self._degrees(world_size)
        micro = spec.batch_size // (dims.dp * spec.grad_accum)
        if micro % self.microbatches:
            options = [m for m in range(1, micro + 1) if micro % m == 0]
            raise ValueError(
                f"microbatches={self.microbatches} must divide the {micro} samples each pipeline "
                f"runs per step (batch_size={spec.batch_size} / data-parallel ranks {dims.dp} / "
                f"grad_accum={spec.grad_accum}); use one of {options}"
            )

    def data_parallel(self, rank: int, world_size: int) -> tuple[int, int]:
        dims = self._degrees(world_size)
        return dims.coords(rank)["dp"], dims.dp

    def loss_share(self, rank: int, world_size: int) -> float:
        dims = self._degrees(world_size)
        last = dims.coords(rank)["pp"] == dims.pp - 1
        return 1.0 / (dims.dp * dims.tp) if last else 0.0

    def parallelize(self, model: nn.Module, ctx: RankContext) -> nn.Module:
        dims = self._degrees(ctx.world_size)
        mesh = dims.build_mesh(ctx.device.type) if ctx.world_size > 1 else None
        return self._pipeline(model, ctx, dims, mesh, prepare=None)

    def _pipeline(
        self, model: nn.Module, ctx: RankContext, dims: Any, mesh: Any, prepare: Any
    ) -> nn.Module:
        """This rank's stages of ``model`` over the mesh's ``pp`` axis (see ``apply_pipeline``)."""
        from axon_nb.parallel.pipeline import apply_pipeline

        return apply_pipeline(
            model,
            pp_index=dims.coords(ctx.rank)["pp"],
            pp_size=dims.pp,
            virtual_stages=self.virtual_stages,
            split_points=self.split_points,
            schedule=self.schedule,
            microbatches=self.microbatches,
            device=ctx.device,
            group=mesh["pp"].get_group() if mesh is not None else None,
            prepare=prepare,
        )

    def forward_backward(
        self, model: nn.Module, microbatches: Sequence[Any], step: MicroStep
    ) -> torch.Tensor:
        import torch

        model.loss_fn = step.loss_fn  # type: ignore[assignment]
        model.loss_scale = 1.0 / (self.microbatches * len(microbatches))  # type: ignore[assignment]
        total = torch.zeros((), device=_device(model))
        before = (model.forward_s, model.backward_s)  # type: ignore[attr-defined]
        started = time.perf_counter()
        for inputs, target in microbatches:
            losses: list[torch.Tensor] = []
            args = (inputs,) if model.has_first else ()  # type: ignore[attr-defined]
            with step.autocast():
                model.schedule.step(  # type: ignore[attr-defined,operator]
                    *args, target=target if model.has_last else None, losses=losses
                )
            if losses:
                total = total + torch.stack([loss.detach() for loss in losses]).sum()
        wall = time.perf_counter() - started
        forward = model.forward_s - before[0]  # type: ignore[attr-defined]
        backward = model.backward_s - before[1]  # type: ignore[attr-defined]
        model.last_step = {  # type: ignore[assignment]
            "forward_s": forward,
            "backward_s": backward,
            "bubble": max(0.0, 1.0 - (forward + backward) / wall),
        }
        return total

    def no_sync(self, model: nn.Module) -> Any:
        import contextlib

        return contextlib.nullcontext()  # stages synchronise nothing across micro-batches

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the norm over every stage's gradients (summed over the pipeline ranks)."""
        from axon_nb.parallel.grads import clip_grad_norm_

        # The pipeline's process group; None on one rank, where there is nothing to sum.
        group = model.pp_group  # type: ignore[attr-defined]
        return clip_grad_norm_(model.parameters(), max_norm, group=group)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.root  # type: ignore[return-value]

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The whole model's parameters, gathered from every stage (a collective)."""
        from axon_nb.parallel.pipeline import gather_state

        return gather_state(model)  # type: ignore[arg-type]

    def report(self, model: nn.Module) -> dict[str, Any]:
        return dict(getattr(model, "last_step", {}))

    def get_state(self, model: nn.Module, optimizer: Any, *, full: bool) -> dict[str, Any]:
        """Unsharded, named model and optimizer state on every rank, whatever ``full`` says:
        a checkpoint of a pipeline loads into any cut (or any other strategy)."""
        from axon_nb.parallel.pipeline import gather_optimizer_state, gather_state

        return {
            "model": gather_state(model),  # type: ignore[arg-type]
            "optimizer": gather_optimizer_state(model, optimizer),  # type: ignore[arg-type]
        }

    def set_state(self, model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
        from axon_nb.parallel.pipeline import load_full_state

        load_full_state(model, optimizer, state)  # type: ignore[arg-type]


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _device(model: nn.Module) -> Any:
    return next(model.parameters()).device
