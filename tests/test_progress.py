"""Long calls show their progress: ``train``, ``evaluate``, ``predict`` and ``compare`` draw a
text bar (steps done/asked, elapsed, time left, the last loss) in a terminal, nothing where
output goes to a file; ``train``'s dashboard shows the same with the loss."""

from __future__ import annotations

import io
import re

import pytest
from models import make_data, make_mlp, mse

import axon_nb
from axon_nb import DDP, ZeRO
from axon_nb.train.progress import ProgressBar, clock
from axon_nb.widgets._state import DashboardState

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


class Terminal(io.StringIO):
    """What a bar sees of a terminal: a file that is a TTY."""

    def isatty(self) -> bool:
        return True


BAR = re.compile(
    r"(.+?) +(\d+)%\|[█ ]{20}\| (\d+)/(\d+) \[(\d\d:\d\d)<([\d:?]+)(, loss [\d.e+-]+)?\]"
)


def last_bars(text: str) -> dict[str, re.Match[str]]:
    """Each label's last drawn bar."""
    bars: dict[str, re.Match[str]] = {}
    for drawn in text.replace("\n", "\r").split("\r"):
        match = BAR.fullmatch(drawn)
        if match:
            bars[match.group(1)] = match
    return bars


def test_a_bar_draws_in_a_terminal_and_nothing_into_a_file() -> None:
    terminal, log = Terminal(), io.StringIO()
    for file in (terminal, log):
        bar = ProgressBar("evaluate", 40, file=file)
        bar.update(10, loss=0.5)
        bar.close()
    drawn = terminal.getvalue()
    assert drawn.startswith("\revaluate  25%|█████               | 10/40 [00:00<00:00, loss 0.5]")
    assert drawn.endswith("\n") and log.getvalue() == ""
    assert (clock(None), clock(75), clock(3725)) == ("?", "01:15", "1:02:05")


def test_train_evaluate_predict_and_compare_draw_their_bars(
    pooled_cluster_2: axon_nb.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    data = make_data(64)
    pooled_cluster_2.train(make_mlp, data, loss=mse, strategy=DDP(), steps=12, batch_size=8)
    pooled_cluster_2.evaluate(data, loss=mse, batch_size=4)
    pooled_cluster_2.predict(data, batch_size=4)
    pooled_cluster_2.compare(
        [DDP(), ZeRO(stage=1)], model=make_mlp, data=data, loss=mse, steps=3, batch_size=8
    )
    bars = last_bars(terminal.getvalue())
    train = bars["train model"]
    assert train.group(3, 4) == ("12", "12") and train.group(2) == "100" and train.group(7)
    # 64 samples, 2 ranks, batch 4: 8 rounds each; the loss so far of rank 0's batches
    evaluate = bars["evaluate"]
    assert evaluate.group(3, 4) == ("8", "8") and evaluate.group(7)
    assert bars["predict"].group(3, 4) == ("8", "8")
    compared = [b for label, b in bars.items() if label.startswith("compare ")]
    assert len(compared) == 2 and all(b.group(3, 4) == ("3", "3") for b in compared)


def test_output_to_a_file_gets_no_bar(
    pooled_cluster_2: axon_nb.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = io.StringIO()
    monkeypatch.setattr("sys.stdout", log)
    data = make_data(64)
    pooled_cluster_2.train(make_mlp, data, loss=mse, strategy=DDP(), steps=6, batch_size=8)
    pooled_cluster_2.evaluate(data, loss=mse, batch_size=4)
    assert "|" not in log.getvalue() and "\r" not in log.getvalue()


def test_the_dashboard_progress_carries_the_last_loss() -> None:
    state = DashboardState(1)
    assert state.progress()["loss"] is None
    record = {"step": 1, "loss": 0.25, "rank_loss": 0.25, "samples_per_s": 8.0}
    message = {"status": "running", "step": 1, "start_step": 0, "total_steps": 4,
               "elapsed_s": 1.0, "heartbeat": 0.0, "records": [record]}  # fmt: skip
    state.update(0, message)
    assert state.progress()["loss"] == 0.25
