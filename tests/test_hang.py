"""Hang diagnosis on real MPI clusters: every rank's stacks and collective while they are stuck
(``cluster.stacks()``, ``%axon_stacks``), the hang timeout, and a collective timeout in training.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator

import pytest
from IPython.core.error import UsageError

import axon_nb
from axon_nb.cluster.stacks import StackReport

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def stuck_here(seconds: float) -> None:
    """User code that takes a while (the rank every other rank waits for)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)


STUCK_LINE = inspect.getsourcelines(stuck_here)[1] + 4  # the time.sleep line


def rank1_late(seconds: float) -> float:
    """Rank 0 waits in an all-reduce while rank 1 is in ``stuck_here``; then both finish."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        stuck_here(seconds)
    t = torch.ones(8)
    dist.all_reduce(t)
    return t[0].item()


def mse_late_on_rank1(step: int, seconds: float):
    """``mse``, except that rank 1 spends ``seconds`` in ``stuck_here`` at its ``step``-th call."""
    calls = {"n": 0}

    def loss(output, target):
        import torch.distributed as dist
        from models import mse

        calls["n"] += 1
        if dist.get_rank() == 1 and calls["n"] == step:
            stuck_here(seconds)
        return mse(output, target)

    return loss


def _stacks_when_waiting(cluster: axon_nb.Cluster, seconds: float = 20) -> StackReport:
    """The first report in which rank 0 waits in a collective and rank 1 is in ``stuck_here``
    (on a loaded machine rank 1 may get there after rank 0 waits)."""
    deadline = time.monotonic() + seconds
    while True:
        report = cluster.stacks()
        collective = report.ranks[0].collective
        waiting = collective is not None and collective.waiting
        if (waiting and "stuck_here" in report.stacks.get(1, "")) or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def _sum_ranks() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -5, float("nan"), True, "10"])
def test_a_hang_timeout_that_is_not_a_positive_number_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="hang_timeout must be a positive, finite number"):
        axon_nb.Cluster(n=2, hang_timeout=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("line", ["2 --hang-timeout 0", "2 --hang-timeout -1"])
def test_the_magic_refuses_a_bad_hang_timeout_with_what_to_do(shell, line: str) -> None:
    with pytest.raises(UsageError, match=r"positive, finite number of seconds.*--hang-timeout 300"):
        shell.run_line_magic("axon_cluster", line)


# -- stacks on demand -----------------------------------------------------------------------


def _import_this_module_on_the_ranks(cluster: axon_nb.Cluster) -> None:
    # Functions of this module reach the ranks by reference: the first one sent imports the
    # module there (pytest and all), which can take seconds on a loaded machine. Do it first,
    # so the stacks below are taken where the test means them to be, not inside that import.
    assert cluster.run(_sum_ranks) == [2.0, 2.0]


def test_stacks_show_who_waits_in_which_collective_and_who_is_elsewhere(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    _import_this_module_on_the_ranks(pooled_cluster_2)
    idle = pooled_cluster_2.stacks()
    assert "ranks 0, 1 are idle" in str(idle)

    ar = pooled_cluster_2.send(rank1_late, 8).ar
    report = _stacks_when_waiting(pooled_cluster_2)
    text = str(report)
    assert report.missing == ()
    waiting = report.ranks[0].collective
    assert waiting is not None and waiting.kind == "all_reduce" and waiting.waiting
    assert waiting.group_size == 2 and waiting.bytes == 32
    assert f"rank 0 waits in all_reduce #{waiting.seq} (group of 2, 32 B)" in text
    assert "at test_hang.py" in text and "in rank1_late" in text
    assert f"rank 1 is elsewhere: test_hang.py:{STUCK_LINE} in stuck_here" in text
    assert len(text.splitlines()) <= 4  # compact: a header, one line per place, a hint
    # The full stacks are on the object: rank 1's main thread, and its other threads too.
    assert "stuck_here" in report.stacks[1] and "time.sleep(0.05)" in report.stacks[1]
    assert "all_reduce" in report.stacks[0]
    assert len(report.ranks[1].threads) > 1
    assert repr(report) == text

    assert ar.get(timeout=60) == [2.0, 2.0]  # rank 1 came; the world is fine
    assert pooled_cluster_2.run(_sum_ranks) == [2.0, 2.0]
    after = pooled_cluster_2.stacks().ranks[0].collective
    assert after is not None and after.done and after.seq > waiting.seq


def test_a_rank_holding_the_gil_in_c_is_shown_from_its_native_dump(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    _import_this_module_on_the_ranks(pooled_cluster_2)
    ar = pooled_cluster_2.send(hold_the_gil, ranks=[1]).ar
    deadline = time.monotonic() + 30
    while True:  # until rank 1 is inside the regex (it answers before it gets there)
        report = pooled_cluster_2.stacks(timeout=2.0)
        if report.missing == (1,) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert report.missing == (1,)
    assert "rank 1 did not answer" in str(report)
    assert "test_hang.py" in str(report) and "in hold_the_gil" in str(report)
    assert "hold_the_gil" in report.stacks[1]
    pooled_cluster_2.interrupt([1])
    with pytest.raises(Exception, match="KeyboardInterrupt"):
        ar.get(timeout=60)
    assert pooled_cluster_2.run(_sum_ranks) == [2.0, 2.0]


def hold_the_gil() -> None:
    """A regular expression that backtracks for minutes without releasing the GIL."""
    import re

    re.match(r"(a+)+$", "a" * 40 + "b")


# -- through the magics, with a hang timeout ------------------------------------------------


@pytest.fixture(scope="module")
def hang_shell(shell) -> Iterator:
    shell.run_line_magic("axon_cluster", "2 --timeout 60 --hang-timeout 2")
    yield shell
    shell.run_line_magic("axon_cluster", "--stop")


def test_axon_stacks_prints_the_report(hang_shell, capsys) -> None:
    cluster = axon_nb.current_cluster()
    assert cluster.options.hang_timeout == 2
    ar = cluster.send(rank1_late, 6).ar
    _stacks_when_waiting(cluster)
    capsys.readouterr()
    hang_shell.run_line_magic("axon_stacks", "")
    out = capsys.readouterr().out
    assert "rank 0 waits in all_reduce" in out
    assert f"rank 1 is elsewhere: test_hang.py:{STUCK_LINE} in stuck_here" in out
    hang_shell.run_line_magic("axon_stacks", "--full --ranks 1")
    out = capsys.readouterr().out
    assert "Stacks of 1 rank at" in out and "[rank 1] Thread 'MainThread'" in out
    assert "time.sleep(0.05)" in out
    assert ar.get(timeout=60) == [2.0, 2.0]
    with pytest.raises(ValueError, match=r"subset of 0\.\.1"):
        hang_shell.run_line_magic("axon_stacks", "--ranks 5")


def test_a_cell_without_progress_prints_the_stacks_once_and_goes_on(hang_shell, capsys) -> None:
    cluster = axon_nb.current_cluster()
    started = time.monotonic()
    assert cluster.run(rank1_late, 7) == [2.0, 2.0]  # it still finishes
    assert time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert err.count("No progress for 2 s (no rank finished or printed)") == 1
    assert "rank 0 waits in all_reduce" in err
    assert f"rank 1 is elsewhere: test_hang.py:{STUCK_LINE} in stuck_here" in err


def test_an_axon_cell_without_progress_shows_its_own_lines(hang_shell, capsys) -> None:
    cell = "import time\nif rank == 1:\n    time.sleep(6)\ndist.barrier()\n"
    hang_shell.run_cell_magic("axon", "", "import torch.distributed as dist")
    hang_shell.run_cell_magic("axon", "", cell)
    err = capsys.readouterr().err
    assert "rank 0 waits in barrier #" in err and "at cell:4 in <module>" in err
    assert "rank 1 is elsewhere: cell:3 in <module>" in err


def test_a_cell_that_prints_is_making_progress(hang_shell, capsys) -> None:
    cell = "import time\nfor i in range(8):\n    print(i, flush=True)\n    time.sleep(0.5)\n"
    hang_shell.run_cell_magic("axon", "", cell)
    assert "No progress" not in capsys.readouterr().err


def test_training_without_steps_shows_the_stacks_on_the_dashboard(hang_shell, capsys) -> None:
    from models import make_data, make_mlp

    cluster = axon_nb.current_cluster()
    handle = cluster.train(
        model=make_mlp, data=make_data, loss=mse_late_on_rank1(3, 7), steps=4, batch_size=16,
        block=False,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    shown = ""  # (a slow start may be reported first: no step for 2 s yet either)
    while "stuck_here" not in shown and time.monotonic() < deadline:
        time.sleep(0.1)
        shown = handle.dashboard.hang_report
    result = handle.wait(timeout=60)
    assert result.step == 4
    assert shown.startswith("No step for 2 s")
    assert f"rank 1 is elsewhere: test_hang.py:{STUCK_LINE} in stuck_here" in shown
    assert "rank 0 waits in all_reduce" in shown and "async" in shown  # DDP's gradient bucket
    assert "no rank finished a step" in capsys.readouterr().err
    assert handle.dashboard.hang_report == ""  # cleared once steps came again


# -- a collective timeout ends a stuck training run -----------------------------------------


@pytest.mark.timeout(180)
def test_training_stuck_in_a_collective_past_the_timeout_fails_naming_the_ranks() -> None:
    from models import make_data, make_mlp

    with axon_nb.Cluster(n=2, timeout=5) as short:
        started = time.monotonic()
        with pytest.raises(axon_nb.RankError) as info:
            short.train(
                # rank 1 late by 12 s: well past rank 0's 5 s collective timeout
                model=make_mlp, data=make_data, loss=mse_late_on_rank1(2, 12), steps=4,
                batch_size=16,
            )  # fmt: skip
        assert time.monotonic() - started < 90
        message = str(info.value)
        print(message)
        assert info.value.rank == 0
        assert "rank 1" in message
        assert short.run(_sum_ranks) == [2.0, 2.0]
