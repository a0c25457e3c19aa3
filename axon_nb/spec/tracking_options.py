"""What a run writes beside training: experiment trackers (``log_to``, ``log_dir``) and
profiler traces (``trace``), checked on the kernel before anything runs. Pure Python.

Example::

    normalize({"log_to": "tensorboard", "name": "gpt"})
    # {"log_to": ("tensorboard",), "log_dir": "/abs/runs/gpt"}
"""

from __future__ import annotations

import os
from typing import Any

TRACKERS = ("tensorboard", "mlflow")
"""``log_to`` values."""


def normalize(options: dict[str, Any]) -> dict[str, Any]:
    """``log_to`` as a tuple, ``log_dir`` absolute (default ``runs/<name>`` when something is
    logged or traced), ``trace`` as a tuple; only the keys present in ``options``
    (``train_local`` has none of them)."""
    out: dict[str, Any] = {}
    log_to = options.get("log_to")
    if isinstance(log_to, str):
        log_to = (log_to,)
    if isinstance(log_to, list | tuple):
        log_to = tuple(log_to)
    if "log_to" in options:
        out["log_to"] = log_to or None
    if "log_dir" in options:
        log_dir = options.get("log_dir")
        if log_dir is None and (log_to or options.get("trace")):
            log_dir = os.path.join("runs", str(options.get("name") or "model"))
        out["log_dir"] = os.path.abspath(os.fspath(log_dir)) if log_dir is not None else None
    trace = options.get("trace")
    if isinstance(trace, list):
        out["trace"] = tuple(trace)
    return out


def problems(log_to: Any, trace: Any, steps: Any) -> list[str]:
    """What is wrong with ``log_to`` and ``trace`` for a call of ``steps`` steps."""
    errors = []
    if log_to is not None:
        listed = isinstance(log_to, tuple)
        unknown = [t for t in log_to if t not in TRACKERS] if listed else [log_to]
        if unknown:
            errors.append(
                f"log_to takes {' and/or '.join(map(repr, TRACKERS))} (a name or a list), "
                f"got {unknown}"
            )
    if trace is not None:
        errors += _trace_problems(trace, steps)
    return errors


def _trace_problems(trace: Any, steps: Any) -> list[str]:
    shape = "trace must be (start_step, steps), e.g. trace=(5, 3) traces the call's steps 5-7"
    if not (isinstance(trace, tuple) and len(trace) == 2):
        return [f"{shape}; got {trace!r}"]
    start, count = trace
    if any(isinstance(v, bool) or not isinstance(v, int) for v in trace) or start < 1 or count < 1:
        return [f"{shape} (both integers >= 1, the call's first step is 1); got {trace!r}"]
    if isinstance(steps, int) and start + count - 1 > steps:
        return [
            f"trace={trace!r} reaches step {start + count - 1}, past this call's {steps} steps: "
            f"trace at most trace=({max(1, steps - count + 1)}, {min(count, steps)})"
        ]
    return []
