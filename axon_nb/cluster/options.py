"""Typed, validated options of a cluster: what `%axon_cluster` flags and `Cluster(...)` map onto."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from axon_nb.spec.notice_signal import check_notice_signal
from axon_nb.spec.placement import BACKENDS

ENGINE_KINDS = ("mpi", "local", "slurm")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterOptions:
    """How many ranks, how they are launched, and how they join the world."""

    n: int
    """Number of ranks (engines)."""
    engines: str = "mpi"
    """``mpi``: one ``mpiexec`` launch, engine id == MPI rank; ``local``: plain local processes;
    ``slurm``: ``mpiexec`` in a Slurm job (submitted with ``sbatch``, or inside the allocation
    this kernel runs in), which starts the ranks with ``srun``."""
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
    hosts: tuple[tuple[str, int], ...] | None = None
    """``(host, slots)`` pairs: MPI starts the ranks on them over ssh, filling each host's
    slots in order; None: every rank on this host."""
    iface: str | None = None
    """With ``hosts``: the network interface the ranks use (gloo, NCCL, MPI and the
    rendezvous); None: the one that routes to this kernel's host."""

    oversubscribe: bool = field(
        default_factory=lambda: os.environ.get("AXON_NB_OVERSUBSCRIBE", "") == "1"
    )
    """Start more ranks on this host than it has devices (GPUs, or cores on CPU); without it
    such a start is refused. Default: ``AXON_NB_OVERSUBSCRIBE=1`` in the environment."""

    partition: str | None = None
    """``engines="slurm"``: the partition to submit to (None: the default one)."""
    time: str | None = None
    """``engines="slurm"``: the job's time limit, as Slurm writes it (``2:00:00``)."""
    detach: bool = False
    """Outlive the kernel: a keeper process, not the kernel, ends the cluster (after
    ``idle_timeout``, or when stopped); any kernel of this user can attach to it by ``name``."""
    name: str | None = None
    """A detached cluster's name, unique per user and host (None: one is made up)."""
    idle_timeout: float = 7200.0
    """A detached cluster ends after this many seconds with no kernel attached and no run
    in progress."""
    preempt_signal: str = "USR2"
    """The preemption notice (Slurm's ``--signal=USR2@90``, ``scancel --signal=USR2``, a spot
    notice) to any rank: a run in ``train`` stops at the next step on every rank and each
    writes its part of a checkpoint. SIGTERM stays axon_nb's stop."""

    @classmethod
    def from_arguments(
        cls,
        n: int,
        *,
        gpus: Sequence[int] | None = None,
        hosts: Sequence[tuple[str, int]] | str | None = None,
        oversubscribe: bool | None = None,
        **options: Any,
    ) -> ClusterOptions:
        """The options of ``Cluster(n, ...)``: ``hosts`` may be ``"node1:4,node2:4"``, and
        ``oversubscribe=None`` takes the environment's default."""
        if isinstance(hosts, str):
            hosts = parse_hosts(hosts)
        if oversubscribe is not None:
            options["oversubscribe"] = oversubscribe
        return cls(
            n=n,
            gpus=tuple(gpus) if gpus is not None else None,
            hosts=tuple((str(h), int(c)) for h, c in hosts) if hosts is not None else None,
            **options,
        )

    @property
    def multi_host(self) -> bool:
        """True when ranks may be started on other hosts."""
        return self.hosts is not None or self.engines == "slurm"

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
            _check_gpus(self.gpus, self.n, self.backend, self.hosts)
        if self.hosts is not None:
            _check_hosts(self.hosts, self.n, self.engines)
        if self.engines != "slurm" and (self.partition or self.time):
            raise ValueError("--partition and --time are Slurm job options: add --engines slurm")
        if self.hosts is None and self.engines != "slurm" and self.iface is not None:
            raise ValueError(
                "--iface chooses the network of a cluster across hosts: give --hosts or "
                "--hostfile too (ranks on one host talk over loopback)"
            )
        for name in ("timeout", "start_timeout"):
            value = getattr(self, name)
            if not _positive_seconds(value):
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{name} must be a positive, finite number of seconds, got {value!r}: "
                    f"e.g. `%axon_cluster 4 {flag} 300`"
                )
        _check_detach(self)
        object.__setattr__(  # (frozen: "SIGUSR2" and "usr2" kept as "USR2")
            self, "preempt_signal", check_notice_signal(self.preempt_signal, cluster=True)
        )
        hang = self.hang_timeout
        if hang is not None and not _positive_seconds(hang):
            raise ValueError(
                f"hang_timeout must be a positive, finite number of seconds, got {hang!r}: e.g. "
                "`%axon_cluster 4 --hang-timeout 300`, or leave it out to never report hangs"
            )


NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A cluster's name: a file name on every system (letters, digits, ``_.-``; 64 at most)."""


def check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"cluster name {name!r}: use letters, digits, '_', '.' and '-' (64 at most), "
            "starting with a letter or digit"
        )


def _check_detach(options: ClusterOptions) -> None:
    if options.name is not None and not options.detach:
        raise ValueError("name= names a detached cluster: add detach=True (--detach)")
    if options.name is not None:
        check_name(options.name)
    if not _positive_seconds(options.idle_timeout):
        raise ValueError(
            f"idle_timeout must be a positive, finite number of seconds, got "
            f"{options.idle_timeout!r}: e.g. `--idle-timeout 2h` or idle_timeout=7200"
        )
    if options.detach and options.multi_host:
        raise ValueError(
            "a detached cluster runs on this host only (its keeper watches processes here): "
            "leave out --hosts and --engines slurm, or do not detach"
        )


def parse_duration(text: str) -> float:
    """``"2h"``, ``"30m"``, ``"90s"`` or ``"7200"`` in seconds. Example::

    parse_duration("1h30m")   # 5400.0
    """
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1, "": 1}
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)([dhms]?))+", text.strip())
    if not parts:
        raise ValueError(f"a duration like 2h, 30m, 90s or 7200, got {text!r}")
    return float(sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([dhms]?)", text)))


def _positive_seconds(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _check_hosts(hosts: tuple[tuple[str, int], ...], n: int, engines: str) -> None:
    if engines != "mpi":
        raise ValueError(
            f"--hosts starts ranks with MPI over ssh: use --engines mpi, not {engines}"
        )
    if not hosts:
        raise ValueError("--hosts lists no host: give e.g. --hosts node1:4,node2:4")
    slots = sum(count for _, count in hosts)
    if n > slots:
        raise ValueError(
            f"{n} ranks do not fit the {slots} slots of --hosts "
            f"{format_hosts(hosts)}: start at most {slots} ranks or list more slots"
        )


def format_hosts(hosts: tuple[tuple[str, int], ...]) -> str:
    """``((h1, 4), (h2, 4))`` as ``"h1:4,h2:4"`` (MPICH's ``-hosts`` form)."""
    return ",".join(f"{host}:{count}" for host, count in hosts)


def parse_hosts(text: str) -> tuple[tuple[str, int], ...]:
    """Parse ``"node1:4,node2:4"`` (a host without ``:N`` has 1 slot) into pairs. Example::

    parse_hosts("node1:4,node2")   # (("node1", 4), ("node2", 1))
    """
    pairs = []
    for part in text.replace("\n", ",").split(","):
        part = part.split("#")[0].strip()
        if not part:
            continue
        host, _, count = part.partition(":")
        try:
            slots = int(count) if count else 1
        except ValueError:
            slots = 0
        if not host or slots < 1:
            raise ValueError(
                f"bad host entry {part!r}: write host or host:slots, e.g. node1:4,node2:4"
            )
        pairs.append((host, slots))
    return tuple(pairs)


def read_hostfile(path: str) -> tuple[tuple[str, int], ...]:
    """Hosts from an MPICH-style host file: one ``host`` or ``host:slots`` per line, ``#``
    comments."""
    try:
        with open(path) as f:
            return parse_hosts(f.read())
    except OSError as e:
        raise ValueError(f"cannot read the host file {path}: {e.strerror}") from None


def _check_gpus(
    gpus: tuple[int, ...], n: int, backend: str, hosts: tuple[tuple[str, int], ...] | None
) -> None:
    if not gpus or any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in gpus):
        raise ValueError(f"gpus must be CUDA device indices like 0,1,2, got {gpus!r}")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"gpus lists a device twice: {gpus!r}; give each device once")
    per_host = n if hosts is None else min(n, max(count for _, count in hosts))
    if backend == "nccl" and len(gpus) < per_host:
        raise ValueError(
            f"--backend nccl needs one GPU per rank, but --gpus lists {len(gpus)} device(s) "
            f"for {per_host} ranks on a host: list {per_host} devices, start {len(gpus)} ranks "
            "a host, or use --backend gloo"
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
