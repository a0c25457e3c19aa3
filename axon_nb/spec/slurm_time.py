"""Slurm's time limits (``sbatch --time``) in seconds, and whether a job's notice, which Slurm
may send early, can still come after its ranks started.

``sbatch --signal=SIG@T`` is documented to come up to 60 s earlier than ``T`` before the limit
(Slurm checks its limits periodically). A notice that comes before a task's Python holds it
(``rank/job_slurm_task.py``) ends the task: the job is lost, not checkpointed.

Example::

    slurm_time_s("1:30:00")           # 5400
    check_notice_time("2", 30)        # fine: the notice comes 30 s in at the earliest
    check_notice_time("1", 30)        # ValueError: it may come as the job starts
"""

from __future__ import annotations

import re

EARLY_S = 60
"""How much earlier than asked Slurm may send ``--signal`` (``man sbatch``)."""

START_S = 30
"""The least time a job's ranks get to start before its notice may come."""

_FORMS = (
    (r"(\d+)", ("m",)),
    (r"(\d+):(\d+)", ("m", "s")),
    (r"(\d+):(\d+):(\d+)", ("h", "m", "s")),
    (r"(\d+)-(\d+)", ("d", "h")),
    (r"(\d+)-(\d+):(\d+)", ("d", "h", "m")),
    (r"(\d+)-(\d+):(\d+):(\d+)", ("d", "h", "m", "s")),
)
_UNIT_S = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def slurm_time_s(text: str) -> int:
    """``text`` in one of Slurm's time forms (``minutes``, ``minutes:seconds``,
    ``hours:minutes:seconds``, ``days-hours``, ``days-hours:minutes``,
    ``days-hours:minutes:seconds``), in seconds."""
    for pattern, units in _FORMS:
        found = re.fullmatch(pattern, text.strip())
        if found is not None:
            return sum(int(v) * _UNIT_S[u] for v, u in zip(found.groups(), units, strict=True))
    raise ValueError(
        f"time_limit={text!r} is not a Slurm time: give minutes ('90'), 'minutes:seconds', "
        "'hours:minutes:seconds', 'days-hours', 'days-hours:minutes' or "
        "'days-hours:minutes:seconds'"
    )


def check_notice_time(time_limit: str, signal_delay_s: int) -> None:
    """Refuse a time limit too short for a notice due ``signal_delay_s`` before it: Slurm may
    send it :data:`EARLY_S` earlier, and it must come :data:`START_S` after the start at the
    earliest (before the ranks hold it, it ends them)."""
    limit = slurm_time_s(time_limit)
    earliest = limit - signal_delay_s - EARLY_S
    if earliest < START_S:
        raise ValueError(
            f"time_limit={time_limit!r} ({limit} s) with signal_delay_s={signal_delay_s}: Slurm "
            f"may send the notice up to {EARLY_S} s before it is due (man sbatch, --signal), "
            f"so {earliest} s after the job starts, before its ranks can hold it, and it would "
            f"end them unsaved. Give a time limit of at least {signal_delay_s + EARLY_S + START_S}"
            " s, or a smaller signal_delay_s"
        )
