"""A recorded metrics stream (2 ranks) for the dashboard's tests, and the changes runs with
more options make to it.

The stream in ``data/stream_2ranks.json`` was recorded from real runs (``TrainHandle``'s
listener): one finished 120-step run, and one where rank 1 raised at its 60th loss call.
``with_evals`` adds evaluations to its records, as runs with ``eval_data`` report them;
``with_layout_change`` marks a ``resume=True`` call under another strategy.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

STREAM = json.loads((Path(__file__).parent / "data" / "stream_2ranks.json").read_text())
EVAL_EVERY = 20


def with_evals(run: dict[str, Any], every: int = EVAL_EVERY) -> dict[str, Any]:
    """The recorded run, its records at every ``every``-th step carrying an evaluation (the
    same on both ranks, as the ranks report it).

    Example::

        run = with_evals(STREAM["finished"])  # steps 20, 40, ... carry "eval"
    """
    run = copy.deepcopy(run)
    for _, message in run["messages"]:
        for record in message["records"]:
            if record["step"] % every == 0:
                loss = 1.1 * record["loss"] + 0.05
                record["eval"] = {"loss": loss, "accuracy": record["step"] / 200, "samples": 256}
    return run


MOVE = {"step": 0, "from": "DDP()", "to": "FSDP()", "seconds": 2.0}
"""A resumed call's layout change, as its every publication carries it (``step``: where the
call began, so its curve starts just after the marker)."""


def with_layout_change(run: dict[str, Any], change: dict[str, Any] = MOVE) -> dict[str, Any]:
    """The recorded run as a ``resume=True`` call under a new strategy publishes it.

    Example::

        run = with_layout_change(STREAM["finished"])  # each message has "layout_change"
    """
    run = copy.deepcopy(run)
    for _, message in run["messages"]:
        assert message["start_step"] == change["step"]
        message["layout_change"] = dict(change)
    return run
