"""What ``%axon_status`` shows about a rank: where it runs and the memory it holds."""

from __future__ import annotations

from typing import Any

import psutil

from axon_nb.metrics.gpu_util import utilization
from axon_nb.rank import runtime


def rank_status() -> dict[str, Any]:
    """This rank's placement and memory (bytes), plus the training runs it holds."""
    from axon_nb.rank.training import trainstate

    ctx = runtime.context()
    row: dict[str, Any] = {**ctx.summary(), "rss_bytes": psutil.Process().memory_info().rss}
    if ctx.device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(ctx.device)
        row.update(
            cuda_allocated=torch.cuda.memory_allocated(ctx.device),
            cuda_reserved=torch.cuda.memory_reserved(ctx.device),
            cuda_total=total,
            cuda_free=free,
            **utilization(ctx.device),
        )
    row["runs"] = {name: state.step for name, state in trainstate.runs().items()}
    return row
