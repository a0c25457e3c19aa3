"""``Strategy``: a typed config saying how a model is spread over the ranks.

A strategy holds only the options it honours, checked when it is built (every problem listed
at once). A strategy that takes all of one technique's options inherits them from that
technique's config (``DDP`` from ``DDPConfig``): each option is declared once, with its default
and docstring. It maps to two things the ranks use and nothing else:

- ``dims(world_size, ranks_per_host)``: the :class:`~axon_nb.spec.parallel_dims.ParallelDims`
  (degrees of data, tensor and pipeline parallelism);
- ``config()``: the :class:`~axon_nb.spec.parallel_config.ParallelConfig` (options per technique).

``axon_nb.parallel.parallelize`` applies them on every rank; strategies never run code there
and never call each other. This module is pure Python: the kernel builds and checks strategies
without importing torch.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from axon_nb.spec.parallel_config import ParallelConfig
from axon_nb.spec.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    C = TypeVar("C", bound=DataclassInstance)


# (not slotted: a strategy inherits its technique's config, which is, and two slotted bases
# cannot be combined)
@dataclass(frozen=True, kw_only=True, repr=False)
class Strategy:
    """Base of all strategies; on its own it trains the model as is, on one rank.

    Subclasses are ``@dataclass(frozen=True, kw_only=True, repr=False)`` configs with ``name``
    set, which inherit the options of the config they take whole (``class DDP(Strategy,
    DDPConfig)``); they override ``dims``, ``config`` and ``problems``.
    """

    name: ClassVar[str] = "single_device"
    shown: ClassVar[tuple[str, ...]] = ()
    """Options the repr shows even at their default (it shows the others only when set)."""

    activation_checkpointing: bool = False
    """Recompute the activations of every ``interval``-th block in backward (less memory).
    Blocks are the entries of the model's ``nn.ModuleList`` (an ``nn.Sequential``'s children
    when it has none)."""
    interval: int = 1
    """With ``activation_checkpointing``: checkpoint blocks 0, interval, 2 x interval, ..."""

    def __post_init__(self) -> None:
        errors = self.problems()
        if errors:
            raise ValueError(
                f"invalid {type(self).__name__} options:\n  - " + "\n  - ".join(errors)
            )

    def problems(self) -> list[str]:
        """Every option that is out of range or that this strategy cannot honour."""
        if (
            not isinstance(self.interval, int)
            or isinstance(self.interval, bool)
            or (self.interval < 1)
        ):
            return [
                f"activation checkpoint interval must be an integer >= 1, got {self.interval!r}"
            ]
        return []

    def dims(self, world_size: int, ranks_per_host: int = 1) -> ParallelDims:
        """The degrees this strategy runs with on ``world_size`` ranks (``ValueError`` if it
        cannot); ``ranks_per_host`` sets defaults such as hybrid sharding's group size."""
        if world_size != 1:
            raise ValueError(
                f"{self!r} trains on one rank; the world has {world_size}. Use DDP(), FSDP() "
                "or another distributed strategy"
            )
        return ParallelDims(world_size=1)

    def config(self) -> ParallelConfig:
        """The options ``parallelize`` applies on the ranks."""
        return ParallelConfig(activation_checkpointing=self._checkpoint_every())

    def describe(self) -> str:
        """One line for logs and results."""
        return repr(self)

    def __repr__(self) -> str:
        changed = []
        # (the options of every strategy first, as declared: not after an inherited config's)
        base = [f for f in fields(self) if f.name in _BASE_OPTIONS]
        for f in [*base, *(f for f in fields(self) if f.name not in _BASE_OPTIONS)]:
            default = f.default if f.default is not MISSING else None
            value = getattr(self, f.name)
            if value != default or f.name in self.shown:
                changed.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(changed)})"

    def _checkpoint_every(self) -> int:
        return self.interval if self.activation_checkpointing else 0


@dataclass(frozen=True, kw_only=True, repr=False)
class SingleDevice(Strategy):
    """No parallelism: the model trains as is on one rank (``train_local``'s default).

    Example::

        axon_nb.train_local(model=make_model, data=ds, strategy=SingleDevice(), steps=20)
    """

    name: ClassVar[str] = "single_device"


_BASE_OPTIONS = ("activation_checkpointing", "interval")


def config_from(cls: type[C], source: object, **changes: Any) -> C:
    """A ``cls`` config (of ``axon_nb.spec.parallel_config``) with ``source``'s options of the
    same names (lists as tuples), the others at their defaults, and ``changes`` over them.

    Example::

        config_from(FSDPConfig, ZeRO(stage=3, cpu_offload=True))   # FSDPConfig(cpu_offload=True)
    """
    values = {
        f.name: _frozen(getattr(source, f.name)) for f in fields(cls) if hasattr(source, f.name)
    }
    return cls(**{**values, **changes})


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, for error messages that say what would fit."""
    return [d for d in range(1, n + 1) if n % d == 0]
