"""GPU utilisation and memory-bandwidth use from NVML (``nvidia-ml-py``), where it is there.

NVML reports, over its last sample period (1/6 s to 1 s, by GPU), the percentage of time a
kernel was running (``gpu_util``) and the percentage of time device memory was being read or
written (``memory_bw_util``). A CPU rank, a machine without the NVIDIA driver, or a GPU NVML
cannot see gives no figures, never an error.

Example::

    utilization(torch.device("cuda", 0))  # {"gpu_util": 97, "memory_bw_util": 41}
    utilization(torch.device("cpu"))      # {}
"""

from __future__ import annotations

import functools
from typing import Any


def utilization(device: Any) -> dict[str, int]:
    """``gpu_util`` and ``memory_bw_util`` (percent) of the CUDA ``device``; ``{}`` without NVML."""
    if getattr(device, "type", None) != "cuda":
        return {}
    handle = _handle(device.index if device.index is not None else 0)
    if handle is None:
        return {}
    import pynvml

    try:
        rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
    except pynvml.NVMLError:
        return {}
    return {"gpu_util": int(rates.gpu), "memory_bw_util": int(rates.memory)}


@functools.cache
def _handle(index: int) -> Any:
    """NVML's handle for torch's device ``index`` (matched by UUID, so ``CUDA_VISIBLE_DEVICES``
    renumbering does not matter), or None."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    except Exception:  # no package, no driver, no such device: no figures
        return None
