"""Typed, validated options of a cluster: what `%axon_cluster` flags and `Cluster(...)` map onto."""

from __future__ import annotations

from dataclasses import dataclass

from axon_nb.rank.placement import BACKENDS

ENGINE_KINDS = ("mpi", "local")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterOptions:
    """How many ranks, how they are launched, and how they join the world."""

    n: int
    """Number of ranks (engines)."""
    engines: str = "mpi"
    """``mpi``: one ``mpiexec`` launch, engine id == MPI rank; ``local``: plain local processes."""
    backend: str = "auto"
    """``auto`` (nccl when every rank has a GPU, else gloo), ``nccl`` or ``gloo``."""
    gpus: tuple[int, ...] | None = None
    """CUDA devices to use on each host, local rank ``i`` getting ``gpus[i]``; default: all."""
    timeout: float = 300.0
    """Timeout of collectives, in seconds (``init_process_group(timeout=...)``)."""
    start_timeout: float = 180.0
    """How long starting the engines and joining the world may take, in seconds."""
    hang_timeout: float | None = None
    """Seconds without progress (no step, or no rank finishing or printing) after which every
    rank's stacks are shown once; None: never."""

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(
                f"the number of ranks must be a positive integer, got {self.n!r}: "
                "e.g. `%axon_cluster 4` or `Cluster(n=4)`"
            )
        if self.engines not in ENGINE_KINDS:
            raise ValueError(
                f"unknown engines {self.engines!r}: choose one of {', '.join(ENGINE_KINDS)}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"unknown backend {self.backend!r}: choose one of {', '.join(BACKENDS)}"
            )
        if self.gpus is not None:
            _check_gpus(self.gpus, self.n, self.backend)
        for name in ("timeout", "start_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        hang = self.hang_timeout
        if hang is not None and (
            isinstance(hang, bool) or not isinstance(hang, int | float) or not hang > 0
        ):
            raise ValueError(
                f"hang_timeout must be a positive number of seconds, got {hang!r}: e.g. "
                "`%axon_cluster 4 --hang-timeout 300`, or leave it out to never report hangs"
            )


def _check_gpus(gpus: tuple[int, ...], n: int, backend: str) -> None:
    if not gpus or any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in gpus):
        raise ValueError(f"gpus must be CUDA device indices like 0,1,2, got {gpus!r}")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"gpus lists a device twice: {gpus!r}; give each device once")
    # Every launcher here starts all ranks on this host, so this is known before starting.
    if backend == "nccl" and len(gpus) < n:
        raise ValueError(
            f"--backend nccl needs one GPU per rank, but --gpus lists {len(gpus)} device(s) "
            f"for {n} ranks: list {n} devices, start {len(gpus)} ranks, or use --backend gloo"
        )


def parse_gpus(text: str | None) -> tuple[int, ...] | None:
    """Parse ``"0,1,3"`` into ``(0, 1, 3)``; ``None`` or empty means all devices."""
    if text is None or text.strip() == "":
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"--gpus takes comma-separated device indices like 0,1,2, got {text!r}"
        ) from None
