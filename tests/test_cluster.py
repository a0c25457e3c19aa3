"""The Python API on a real 4-rank MPI cluster (gloo): world, environment, faults, restart."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from helpers import ctrl_c_when, engine_pids, until, wait_gone
from helpers import nannies as cluster_nannies

import axon_nb

if TYPE_CHECKING:
    from pool import ClusterPool

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def _world() -> dict:
    import torch
    import torch.distributed as dist

    from axon_nb.rank.runtime import context

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    from mpi4py import MPI

    return {
        "rank": dist.get_rank(),
        "mpi_rank": MPI.COMM_WORLD.Get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "sum": t.item(),
        "env": {k: os.environ[k] for k in keys},
        "timeout_s": context().timeout_s,
    }


def test_ranks_form_one_world_with_torchrun_environment(pooled_cluster_4: axon_nb.Cluster) -> None:
    out = pooled_cluster_4.run(_world)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert [o["mpi_rank"] for o in out] == [0, 1, 2, 3]  # engine id == MPI rank == rank
    assert {o["world_size"] for o in out} == {4}
    assert {o["backend"] for o in out} == {"gloo"}
    assert {o["sum"] for o in out} == {10.0}
    assert {o["timeout_s"] for o in out} == {int(pooled_cluster_4.options.timeout)}
    for r, o in enumerate(out):
        env = o["env"]
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(r), "4")
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(r), "4")  # one host
        assert env["MASTER_ADDR"] == "127.0.0.1"  # loopback: every rank is local
    assert len({o["env"]["MASTER_PORT"] for o in out}) == 1
    assert [r["device"] for r in pooled_cluster_4.ranks] == ["cpu"] * 4


def _imported(module: str) -> bool:
    return module in sys.modules


def test_the_pools_health_check_does_not_import_conftest_on_the_ranks(
    cluster_pool: ClusterPool,
) -> None:
    """The suite's harness stays out of the ranks: conftest.py sets the environment of what
    imports it (a runtime directory, PYTHONPATH, one torch thread), and a rank that imported
    it once left an empty directory in /tmp at each of its ends (os._exit skips atexit)."""
    cluster = cluster_pool.get(2)
    assert cluster_pool.get(2) is cluster  # the second get checked its health on the ranks
    assert cluster.run(_imported, "conftest", stream=False) == [False, False]


def test_run_passes_arguments_and_selects_ranks(pooled_cluster_4: axon_nb.Cluster) -> None:
    def scaled(x: int, *, y: int) -> int:
        import torch.distributed as dist

        return dist.get_rank() * x + y

    assert pooled_cluster_4.run(scaled, 10, y=1) == [1, 11, 21, 31]
    assert pooled_cluster_4.run(scaled, 10, y=0, ranks=[3, 1]) == [10, 30]
    with pytest.raises(ValueError, match=r"subset of 0\.\.3"):
        pooled_cluster_4.run(scaled, 1, y=0, ranks=[4])


def test_error_names_the_rank_that_raised_first(pooled_cluster_4: axon_nb.Cluster) -> None:
    def fail_on_two() -> None:
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 2:
            raise ValueError("bad shard on this rank")
        dist.all_reduce(torch.ones(1))  # the others wait for rank 2, which never comes

    with pytest.raises(axon_nb.RankError) as info:
        pooled_cluster_4.run(fail_on_two, stream=False)
    assert info.value.rank == 2
    assert info.value.ename == "ValueError"
    assert "bad shard on this rank" in info.value.traceback
    assert "rank 2 raised ValueError" in "\n".join(info.value._render_traceback_())
    # The ranks left waiting in the collective were released: the world still works.
    assert {o["sum"] for o in pooled_cluster_4.run(_world)} == {10.0}


def _fail_on_two_and_leave_slowly() -> None:
    """Rank 2 raises while the others wait for it in an all-reduce; ranks 1 and 3 take 3 s
    to leave theirs once it fails (as a loaded machine makes them), with Ctrl-C ignored."""
    import signal
    import time

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 2:
        raise ValueError("bad shard on this rank")
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN) if rank in (1, 3) else None
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError:
        if rank in (1, 3):
            time.sleep(3)  # well past a release round's 1 s
        raise
    finally:
        if saved is not None:
            signal.signal(signal.SIGINT, saved)


def test_ranks_slow_to_leave_a_failed_collective_do_not_leave_a_peer_stuck(
    pooled_cluster_4: axon_nb.Cluster,
) -> None:
    """Releasing a collective goes round by round (rank 2's connections free ranks 1 and 3,
    theirs free rank 0). Once, under load, a round freed nobody within its second and the
    release gave up: rank 0 stayed in its all-reduce until the 120 s collective timeout, and
    the next call waited for it."""
    started = time.monotonic()
    with pytest.raises(axon_nb.RankError) as info:
        pooled_cluster_4.run(_fail_on_two_and_leave_slowly, stream=False)
    assert info.value.rank == 2
    assert {o["sum"] for o in pooled_cluster_4.run(_world)} == {10.0}
    assert time.monotonic() - started < 40


def _allreduce_forever() -> None:
    import torch
    import torch.distributed as dist

    t = torch.ones(64)
    while True:
        dist.all_reduce(t)
        time.sleep(0.001 * dist.get_rank())  # ranks drift apart, as real work does


def test_ctrl_c_interrupts_all_ranks_and_the_world_stays_usable(
    pooled_cluster_4: axon_nb.Cluster,
) -> None:
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        pooled_cluster_4.run(_allreduce_forever)
    assert time.monotonic() - started < 30
    assert {o["sum"] for o in pooled_cluster_4.run(_world)} == {10.0}


def _one_rank_a_collective_ahead(ready: str) -> None:
    """Rank 3 issues an all-reduce no peer matches (as when Ctrl-C stopped the others just
    before they issued theirs), then every rank says so (a file ``ready``-rank) and waits for
    the interrupt."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 3:
        dist.all_reduce(torch.ones(1024), async_op=True)
    Path(f"{ready}-{dist.get_rank()}").touch()
    time.sleep(60)


def _ctrl_c_when_all_exist(paths: list[Path]) -> None:
    ctrl_c_when(lambda: all(p.exists() for p in paths))


def test_ctrl_c_after_ranks_issued_different_collectives_re_forms_the_world(
    pooled_cluster_4: axon_nb.Cluster, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Without the re-forming, the next all-reduce pairs with rank 3's stale one: gloo aborts
    the rank ("Received data size doesn't match")."""
    ready = tmp_path / "ready"
    _ctrl_c_when_all_exist([Path(f"{ready}-{r}") for r in range(4)])
    with pytest.raises(KeyboardInterrupt):
        pooled_cluster_4.run(_one_rank_a_collective_ahead, str(ready))
    assert "the process group was re-formed" in capfd.readouterr().err
    assert {o["sum"] for o in pooled_cluster_4.run(_world)} == {10.0}


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_wait_past_its_timeout_interrupts_the_ranks_and_says_which(
    pooled_cluster_4: axon_nb.Cluster,
) -> None:
    started = time.monotonic()
    late = r"ranks 0, 1, 2, 3 did not finish within 2 s; they were interrupted"
    with pytest.raises(axon_nb.AxonError, match=late):
        pooled_cluster_4.send(_sleep, 40).wait(timeout=2)
    assert time.monotonic() - started < 30
    assert {o["sum"] for o in pooled_cluster_4.run(_world)} == {10.0}


class _SwallowsCtrlC:
    """Ctrl-C delivered while the kernel's main thread runs this deallocator: the handler's
    KeyboardInterrupt is raised in it and lost ("Exception ignored in"), as CI once saw in
    pyzmq's ``Frame.__dealloc__`` during a wait."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):  # (the handler runs at the next check for signals, in here)
            pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the lost one)
def test_a_ctrl_c_whose_keyboard_interrupt_was_lost_still_interrupts_the_ranks(
    pooled_cluster_4: axon_nb.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from axon_nb.cluster import waiting

    flush = waiting._flush
    calls = []

    def flush_then_lose_a_ctrl_c(streams: object) -> None:
        calls.append(1)
        if len(calls) == 20:  # (a second into the wait)
            _SwallowsCtrlC()  # (freed at once, on the main thread)
        flush(streams)

    monkeypatch.setattr(waiting, "_flush", flush_then_lose_a_ctrl_c)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        pooled_cluster_4.run(_sleep, 40)
    assert len(calls) >= 20
    assert time.monotonic() - started < 30  # not after the ranks' 40 s
    monkeypatch.undo()
    assert {o["sum"] for o in pooled_cluster_4.run(_world)} == {10.0}


def test_a_second_ctrl_c_while_the_world_re_forms_waits_for_it(
    pooled_cluster_4: axon_nb.Cluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The fuzz's one failure in 200 (seed 13): the second of a quick pair of interrupts
    landed while the ranks were joining the new group, and left them with none."""
    from axon_nb.cluster.transport import Transport

    reform = Transport._reform_world

    def interrupted_reform(self: Transport) -> None:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        reform(self)

    monkeypatch.setattr(Transport, "_reform_world", interrupted_reform)
    ready = tmp_path / "ready"
    _ctrl_c_when_all_exist([Path(f"{ready}-{r}") for r in range(4)])
    with pytest.raises(KeyboardInterrupt):
        pooled_cluster_4.run(_one_rank_a_collective_ahead, str(ready))
    monkeypatch.undo()
    assert {o["sum"] for o in pooled_cluster_4.run(_world)} == {10.0}


def _fail_after_rank_3_issued_a_collective() -> None:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 3:  # issued, then the rank fails before waiting on it
        dist.all_reduce(torch.ones(1024), async_op=True)
    raise ValueError(f"rank {dist.get_rank()} failed")


def test_ranks_that_failed_after_different_collectives_are_back_in_step(
    pooled_cluster_4: axon_nb.Cluster,
) -> None:
    """As an interrupt before the training loop's first step left them: without the check,
    the next collective pairs with rank 3's stale one and gloo aborts the rank."""
    with pytest.raises(axon_nb.RankError, match="ValueError"):
        pooled_cluster_4.run(_fail_after_rank_3_issued_a_collective)
    assert {o["sum"] for o in pooled_cluster_4.run(_world)} == {10.0}


def test_killed_engine_is_named_and_restart_recovers(pooled_cluster_4: axon_nb.Cluster) -> None:
    old = engine_pids(pooled_cluster_4)
    timer = threading.Timer(1.5, os.kill, (old[3], signal.SIGKILL))
    timer.start()
    started = time.monotonic()
    with pytest.raises(axon_nb.RankDiedError) as info:
        pooled_cluster_4.run(time.sleep, 60)
    assert time.monotonic() - started < 15  # within seconds, not at the task's end
    assert info.value.rank == 3
    assert "--restart" in str(info.value)
    assert f"The cluster's log ({pooled_cluster_4.log.path}) ends:" in str(
        info.value
    )  # its last words
    with pytest.raises(axon_nb.ClusterBrokenError, match="rank 3 died \\(its output: "):
        pooled_cluster_4.run(_world)
    # the rank's parent says in the log what killed it
    said = f"the engine of this rank (pid {old[3]}) was killed by signal 9 (SIGKILL): sent by"
    assert until(lambda: said in pooled_cluster_4.log.path.read_text(), 10)

    pooled_cluster_4.restart()
    assert wait_gone(old) == []
    assert {o["sum"] for o in pooled_cluster_4.run(_world)} == {10.0}
    assert set(engine_pids(pooled_cluster_4)).isdisjoint(old)


def _crash_in_native_code() -> None:
    """Rank 1 reads address 0 (a segfault, as a bug in an extension's C code gives); rank 0
    waits."""
    import ctypes

    import torch.distributed as dist

    if dist.get_rank() == 1:
        ctypes.string_at(0)
    time.sleep(60)


def test_a_rank_that_crashes_in_native_code_shows_where(pooled_cluster_2: axon_nb.Cluster) -> None:
    """The error names the rank and shows Python's crash report: the stack it crashed in, the
    user's function among its frames; the log says which signal ended it."""
    with pytest.raises(axon_nb.RankDiedError, match="rank 1 died while running") as info:
        pooled_cluster_2.run(_crash_in_native_code)
    text = str(info.value)
    assert "Fatal Python error: Segmentation fault" in text
    assert "in _crash_in_native_code" in text, text
    said = "was killed by signal 11 (SIGSEGV)"
    assert until(lambda: said in pooled_cluster_2.log.path.read_text(), 10)
    pooled_cluster_2.restart()
    assert {o["sum"] for o in pooled_cluster_2.run(_world)} == {3.0}


def test_a_rank_killed_between_calls_is_named_at_the_next_call(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """Killed while idle (the OOM killer, a `kill`): the next call says which rank died and
    what to do (it was ipyparallel's ``KeyError: 1``), and restarting brings the world back."""
    old = engine_pids(pooled_cluster_2)
    os.kill(old[1], signal.SIGKILL)
    assert wait_gone([old[1]]) == []
    with pytest.raises(axon_nb.RankDiedError, match="rank 1 died between calls") as info:
        pooled_cluster_2.run(_world)
    assert "--restart" in str(info.value) and "cluster.rescue(path)" in str(info.value)
    assert pooled_cluster_2.survivors() == ([0], [1])
    with pytest.raises(axon_nb.ClusterBrokenError, match="rank 1 died \\(its output: "):
        pooled_cluster_2.run(_world)
    pooled_cluster_2.restart()
    assert wait_gone(old) == []
    assert {o["sum"] for o in pooled_cluster_2.run(_world)} == {3.0}


def _peer_fails_first_then_rank_1_dies(seen: str) -> None:
    """Rank 0 raises what gloo raises when a peer left ("Connection closed by peer"); rank 1
    dies once the kernel has that error (``seen`` appears): the death is the cause, though
    rank 0's error arrived first. (Rank 1 used to close its connections and die 0.5 s later;
    rank 0's all-reduce then sometimes waited instead of failing, and the death came first.)"""
    import signal
    import time
    from pathlib import Path

    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ConnectionError("Connection closed by peer [127.0.0.1]:12345")
    deadline = time.monotonic() + 60
    while not Path(seen).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_death_is_reported_as_the_cause_even_when_a_peers_error_comes_first(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from axon_nb.cluster import waiting

    seen = tmp_path / "kernel-has-rank-0s-error"
    settle = waiting._settle_after_failure

    def settle_once_seen(*args: object) -> str:
        seen.touch()  # the kernel waits for the others after the first failure it got
        return settle(*args)

    monkeypatch.setattr(waiting, "_settle_after_failure", settle_once_seen)
    with pytest.raises(axon_nb.RankDiedError, match="rank 1 died while running") as info:
        pooled_cluster_2.run(_peer_fails_first_then_rank_1_dies, str(seen))
    monkeypatch.undo()
    assert info.value.failed_ranks[0] == 0  # rank 0's error came in first
    with pytest.raises(axon_nb.ClusterBrokenError, match="rank 1 died"):
        pooled_cluster_2.run(_world)  # the world is known to be broken
    pooled_cluster_2.restart()
    assert {o["sum"] for o in pooled_cluster_2.run(_world)} == {3.0}


@pytest.mark.timeout(120)
def test_local_engines_without_mpi() -> None:
    def rank_and_sum() -> tuple[int, float]:
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return dist.get_rank(), t.item()

    with axon_nb.Cluster(n=2, engines="local") as cluster:
        assert cluster.run(rank_and_sum) == [(0, 2.0), (1, 2.0)]
        pids = engine_pids(cluster)
    assert wait_gone(pids) == []


def test_kernel_side_never_imports_torch() -> None:
    # cluster4 has run torch code on the ranks by now; the test process stays torch-free
    # unless some test imported it directly, so check the package's own imports instead.
    import subprocess

    code = (
        "import sys, axon_nb, axon_nb.magics, axon_nb.cluster.waiting;print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_nanny_that_does_not_answer_does_not_hold_up_the_kernel(
    pooled_cluster_2: axon_nb.Cluster,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C reaches the ranks through their nannies; ipyparallel's blocking send_signal
    waited for ever for a nanny's answer, and the interrupted cell with it."""

    from axon_nb.cluster import control

    monkeypatch.setattr(control, "SIGNAL_REPLY_S", 2.0, raising=False)
    nannies = cluster_nannies(pooled_cluster_2)
    assert len(nannies) == 2
    nannies[0].suspend()
    try:
        started = time.monotonic()
        control.Control(pooled_cluster_2.client, [0, 1]).signal([0, 1], signal.SIGCONT)
        assert time.monotonic() - started < 10
    finally:
        nannies[0].resume()
    assert f"did not confirm signal {int(signal.SIGCONT)} within 2 s" in capsys.readouterr().err
    assert {o["sum"] for o in pooled_cluster_2.run(_world)} == {3.0}
