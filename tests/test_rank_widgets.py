"""A rank that opens a widget (tqdm's progress bar, as transformers' loading does) while the
kernel side is an IPython shell without a Jupyter kernel (terminal IPython, a script): the
ranks' output, idle statuses and metrics keep coming (cluster/iopub_guard.py).

Before the guard, ipyparallel's client raised on the widget's ``comm_open`` and never read
IOPub again: every later print of the cluster was lost, each call waited out its grace."""

from __future__ import annotations

import logging
import time

import pytest
from IPython.core.interactiveshell import InteractiveShell

import axon_nb

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def _progress_bar() -> int:
    """(On every rank) what transformers' from_pretrained shows: a tqdm.auto bar, which in
    an engine is a notebook widget."""
    from tqdm.auto import tqdm

    return sum(tqdm(range(3)))


def _say(word: str) -> int:
    from axon_nb.rank import runtime

    print(f"{word} from {runtime.context().rank}")
    return 1


def test_a_widget_on_a_rank_leaves_the_output_flowing(
    shell: InteractiveShell,
    cluster: axon_nb.Cluster,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="axon_nb.cluster.iopub_guard"):
        assert cluster.run(_progress_bar, stream=False) == [3, 3]
        deadline = time.monotonic() + 10  # (read on the client's IO thread)
        while "could not handle" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    # the bar was a widget, whose messages the client could not handle (the case at stake)
    assert "could not handle" in caplog.text
    capsys.readouterr()
    for _ in range(3):
        assert cluster.run(_say, "hello") == [1, 1]
    out = capsys.readouterr().out
    assert out.count("hello from 0") == 3 and out.count("hello from 1") == 3
    ar = cluster.client[:].apply_async(int)
    assert ar.wait(10) and ar.wait_for_output(5)  # the ranks' idle statuses come in
