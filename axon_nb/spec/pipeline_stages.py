"""Where a pipeline cuts a model: the first layer of each stage, from the layers' parameter
counts or the user's split points. Pure Python: the ranks cut models with it
(``parallel.pipeline``) and the kernel predicts each stage's memory with it
(``axon_nb.estimate``).

Example::

    balanced_starts([10, 50, 50, 50, 50, 10], 2)   # [0, 3]: layers 0-2 and 3-5
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def balanced_starts(sizes: Sequence[int], num_stages: int) -> list[int]:
    """First layer of each stage: contiguous, non-empty stages whose largest parameter count
    is as small as possible (layers without parameters count as 1)."""
    n = len(sizes)
    if num_stages > n:
        raise ValueError(
            f"{num_stages} pipeline stages need at least {num_stages} layers; the model has "
            f"{n}. Use at most {n} stages (num_stages x virtual_stages)"
        )
    weights = [max(1, s) for s in sizes]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # cost[k][i]: the smallest possible largest stage when layers [0, i) form k stages.
    inf = float("inf")
    cost = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    cost[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(cost[k - 1][j], prefix[i] - prefix[j])
                if value < cost[k][i]:
                    cost[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def check_starts(starts: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validate user split points (first layer of every stage after the first)."""
    full = [0, *starts]
    if (
        len(full) != num_stages
        or any(b <= a for a, b in itertools.pairwise(full))
        or (full[-1] >= num_layers)
    ):
        raise ValueError(
            f"split_points must be {num_stages - 1} increasing layer indices between 1 and "
            f"{num_layers - 1} (the first layer of each stage after the first), got "
            f"{tuple(starts)}"
        )
    return full
