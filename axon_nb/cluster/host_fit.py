"""Will the ranks fit this host? Checked before anything is launched, from what the host
says about itself (NVML for GPUs, never CUDA; the cores this process may run on; memory).

Other hosts are checked as they answer: every rank reports its host's devices when it joins
(``spec/placement.py``), and a plan that does not fit fails the start with the same words.
"""

from __future__ import annotations

import os

import psutil

from axon_nb.cluster.options import ClusterOptions
from axon_nb.errors import ClusterStartError

RANK_BYTES = 512 * 2**20
"""Memory a CPU rank needs at least (an engine with torch imported holds about 400 MiB)."""


def visible_gpus() -> int:
    """CUDA devices a rank on this host can use: ``CUDA_VISIBLE_DEVICES`` if set, else what
    NVML counts (0 without a driver). Never initialises CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library: no GPU here
        return 0


def usable_cores() -> int:
    """Cores this process (and so its ranks) may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def check_fits_here(options: ClusterOptions, running: int = 0) -> None:
    """Raise :class:`ClusterStartError` saying what to change when ``options`` ask this host
    for devices, cores or memory it lacks (``running``: ranks already up, a resize's, whose
    memory is taken already). Example::

        check_fits_here(ClusterOptions(n=6))
        # ClusterStartError: 6 ranks on 2 cores: start at most 2, or pass --oversubscribe ...
    """
    if options.multi_host:
        return
    problems = []
    gpus = visible_gpus()
    if options.gpus is not None and max(options.gpus) >= gpus:
        missing = sorted(g for g in options.gpus if g >= gpus)
        problems.append(
            f"--gpus names {', '.join(f'cuda:{g}' for g in missing)}, which this host lacks "
            f"(it has {gpus} GPU{'s' if gpus != 1 else ''}"
            f"{': cuda:0..' + str(gpus - 1) if gpus else ''}): name devices it has, or leave "
            "--gpus out"
        )
    uses_gpus = options.backend == "nccl" or (options.backend == "auto" and gpus > 0)
    if uses_gpus:
        have, what = (len(options.gpus) if options.gpus else gpus), "GPUs"
    else:
        have, what = usable_cores(), "cores"
    if options.n > have and not options.oversubscribe and not problems:
        problems.append(
            f"{options.n} ranks on {have} {what}: ranks would share them and each would run "
            f"slower. Start at most {have}, or pass --oversubscribe "
            "(`Cluster(..., oversubscribe=True)`) to share them anyway"
        )
    available = psutil.virtual_memory().available
    starting = options.n - running
    if starting * RANK_BYTES > available:
        problems.append(
            f"{starting} ranks need about {starting * RANK_BYTES / 2**30:.1f} GiB and this "
            f"host has {available / 2**30:.1f} GiB free: start at most "
            f"{max(1, available // RANK_BYTES)}, or add hosts with --hosts"
        )
    if problems:
        raise ClusterStartError("; ".join(problems) + ". Nothing was started.")
