"""A rank that opens a widget (tqdm's progress bar, as transformers' loading does) while the
kernel side is an IPython shell without a Jupyter kernel (terminal IPython, a script): the
ranks' output, idle statuses and metrics keep coming (cluster/iopub_guard.py).

Before the guard, ipyparallel's client raised on the widget's ``comm_open`` and never read
IOPub again: every later print of the cluster was lost, each call waited out its grace, and
a training run's steps never reached the kernel. In a full run that was the stall of
``test_train_control.py`` on the pooled cluster ("no step for 60 s", alone it passed): an
earlier module had made the ``shell`` (the process's one ``InteractiveShell``, which stays
after its module), and another had loaded a Hugging Face model on the same pooled ranks."""

from __future__ import annotations

import logging
import time

import pytest
from helpers import until
from IPython.core.interactiveshell import InteractiveShell
from models import make_data, make_mlp, mse

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
    pooled_cluster_2: axon_nb.Cluster,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="axon_nb.cluster.iopub_guard"):
        assert pooled_cluster_2.run(_progress_bar, stream=False) == [3, 3]
        deadline = time.monotonic() + 10  # (read on the client's IO thread)
        while "could not handle" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    # the bar was a widget, whose messages the client could not handle (the case at stake)
    assert "could not handle" in caplog.text
    capsys.readouterr()
    for _ in range(3):
        assert pooled_cluster_2.run(_say, "hello") == [1, 1]
    out = capsys.readouterr().out
    assert out.count("hello from 0") == 3 and out.count("hello from 1") == 3
    ar = pooled_cluster_2.client[:].apply_async(int)
    assert ar.wait(10) and ar.wait_for_output(5)  # the ranks' idle statuses come in


def test_a_run_after_a_widget_on_a_rank_streams_its_steps(
    shell: InteractiveShell, pooled_cluster_2: axon_nb.Cluster
) -> None:
    assert pooled_cluster_2.run(_progress_bar, stream=False) == [3, 3]
    handle = pooled_cluster_2.train(
        model=make_mlp, data=make_data, loss=mse, batch_size=32, steps=1_000_000, block=False
    )
    try:
        streamed = until(lambda: len(handle.history) >= 5, 60)
    finally:
        stopped = handle.stop()
    assert streamed, f"no step reached the kernel in 60 s (the ranks were at step {stopped.step})"
    assert [h["step"] for h in handle.history][:5] == [1, 2, 3, 4, 5]
