"""Facts about collectives both sides use: the bus-bandwidth factors of nccl-tests.

nccl-tests reports ``busbw = algbw x factor``, where ``algbw`` is the collective's size (the
whole buffer: the reduced tensor, or the gathered output) over its time. The factor is the
share of that size each rank sends over its link, so ``busbw`` is comparable with the link's
bandwidth whatever the collective. ``rank/observe/collective_timing.py`` measures with it and
``estimate/step_time.py`` predicts with it.
"""

from __future__ import annotations


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' bus factor of ``collective`` on ``n`` ranks, for a size that is the whole
    buffer. Example::

        bus_factor("all_reduce", 4)   # 1.5: each rank sends 2(n-1)/n of the tensor
    """
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast, send/recv: the whole buffer over one link
