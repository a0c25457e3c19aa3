"""The magics, driven through a real IPython shell against a real 2-rank MPI cluster."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
from pathlib import Path

import pytest
from IPython.core.error import UsageError

import axon_nb

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def test_axon_cell_before_any_cluster_says_how_to_start(shell) -> None:
    with pytest.raises(axon_nb.NoClusterError, match="%axon_cluster N"):
        shell.run_cell_magic("axon", "", "print(rank)")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("abc", "positive integer, got 'abc'"),
        ("0", "positive integer"),
        ("2 --gpus x", "comma-separated device indices"),
        ("2 --backend nccl --gpus 0", "nccl needs one GPU per rank"),
        ("", "give the number of ranks"),
    ],
)
def test_bad_arguments_are_usage_errors(shell, line: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("axon_cluster", line)


def test_train_local_twice_leaves_the_users_own_variable_of_the_runs_name(shell) -> None:
    """In the kernel, ``train_local``'s model is the user's object under the run's default
    name ``model``: replacing the run must not delete it (only the variable a rank's
    ``train`` bound for a run goes with it)."""
    from models import make_data, make_mlp, mse

    model = make_mlp()
    shell.user_ns["model"] = model
    for _ in range(2):
        axon_nb.train_local(model=model, data=make_data, loss=mse, steps=1, batch_size=8)
    assert shell.user_ns.get("model") is model
    shell.user_ns.pop("model")


def test_unknown_option_is_a_usage_error(shell) -> None:
    with pytest.raises(UsageError, match="unrecognized arguments: --bogus"):
        shell.run_line_magic("axon_cluster", "2 --bogus")


def test_start_prints_the_rank_table(shell, capsys) -> None:
    shell.run_line_magic("axon_cluster", "2 --timeout 60")
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("rank"))
    assert header.split() == ["rank", "host", "pid", "device", "backend"]
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [(r[0], r[3], r[4]) for r in rows] == [("0", "cpu", "gloo"), ("1", "cpu", "gloo")]


def test_starting_again_does_nothing_without_restart(shell, capsys) -> None:
    before = [r["pid"] for r in _cluster(shell).ranks]
    shell.run_line_magic("axon_cluster", "4")
    assert "already running" in capsys.readouterr().out
    assert [r["pid"] for r in _cluster(shell).ranks] == before


def test_cells_run_on_every_rank_in_persistent_namespaces(shell, capsys) -> None:
    shell.run_cell_magic("axon", "", "import torch.distributed as dist\nx = rank * 10")
    shell.run_cell_magic("axon", "", "print(dist.get_rank(), world_size, device, x)")
    out = capsys.readouterr().out
    assert "[rank 0] 0 2 cpu 0" in out
    assert "[rank 1] 1 2 cpu 10" in out
    shell.run_cell_magic("axon", "--ranks 1", "print('only', rank)")
    out = capsys.readouterr().out
    assert "[rank 1] only 1" in out and "[rank 0]" not in out


def test_no_stream_prints_rank_labelled_output_once_at_the_end(shell, capsys) -> None:
    shell.run_cell_magic("axon", "--no-stream", "print('late', rank)")
    out = capsys.readouterr().out
    assert out.count("[rank 0] late 0") == 1 and out.count("[rank 1] late 1") == 1


def test_cell_results_identical_on_all_ranks_show_once(shell, capsys) -> None:
    shell.run_cell_magic("axon", "", "world_size * 7")
    assert "Out[all ranks]: 14" in capsys.readouterr().out
    shell.run_cell_magic("axon", "", "rank + 100")
    out = capsys.readouterr().out
    assert "Out[rank 0]: 100" in out and "Out[rank 1]: 101" in out


def test_one_display_on_each_rank_shows_each(shell, capsys) -> None:
    # each rank's outputs are a list of one display: it was taken for the display itself
    # (TypeError: string indices must be integers, as Trainer's progress callback ended)
    cell = "from IPython.display import display\ndisplay(f'shown by rank {rank}')"
    shell.run_cell_magic("axon", "", cell)
    out = capsys.readouterr().out
    assert "shown by rank 0" in out and "shown by rank 1" in out


def test_exception_on_one_rank_raises_with_its_traceback(shell) -> None:
    cell = "if rank == 1:\n    raise KeyError('missing on one')\n"
    with pytest.raises(axon_nb.RankError) as info:
        shell.run_cell_magic("axon", "", cell)
    assert info.value.rank == 1 and info.value.failed_ranks == [1]
    assert "missing on one" in info.value.traceback


def test_ctrl_c_interrupts_the_cell_and_collectives_work_after(shell, capsys) -> None:
    cell = textwrap.dedent(
        """
        import torch, time
        t = torch.ones(8)
        while True:
            dist.all_reduce(t)
            time.sleep(0.002 * rank)
        """
    )
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        shell.run_cell_magic("axon", "", cell)
    shell.run_cell_magic("axon", "", "s = torch.ones(1); dist.all_reduce(s); print(s.item())")
    out = capsys.readouterr().out
    assert "[rank 0] 2.0" in out and "[rank 1] 2.0" in out


TORCHRUN_SCRIPT = """
import os, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo")  # reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"script rank={os.environ['RANK']} local={os.environ['LOCAL_RANK']} "
      f"sum={t.item()} args={sys.argv[1:]}", flush=True)
dist.destroy_process_group()
sys.exit(int(os.environ.get("FAIL_ON_RANK", "-1") == os.environ["RANK"]) * 3)
"""


def test_axon_run_runs_a_torchrun_script_and_leaves_the_cluster_usable(
    shell, capsys, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    shell.run_line_magic("axon_run", f"{script} --epochs 1")
    out = capsys.readouterr().out
    assert "[rank 0] script rank=0 local=0 sum=3.0 args=['--epochs', '1']" in out
    assert "[rank 1] script rank=1 local=1 sum=3.0 args=['--epochs', '1']" in out
    shell.run_cell_magic("axon", "", "s = torch.ones(1); dist.all_reduce(s); print(s.item())")
    assert "[rank 1] 2.0" in capsys.readouterr().out


MPI_SCRIPT = """
import os, sys
from mpi4py import MPI   # a singleton MPI of its own: no PMI variables of the engine's
keys = ["GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS"]
leaked = sorted(k for k in os.environ if k.startswith(("PMI_", "HYDI_", "MPI_LOCAL")))
print(f"mpi size={MPI.COMM_WORLD.Get_size()} leaked={leaked}",
      *[f"{k}={os.environ[k]}" for k in keys], flush=True)
"""


def test_axon_run_gives_torchrun_variables_and_no_mpi_ones(shell, capsys, tmp_path) -> None:
    engine_env = _cluster(shell).run(lambda: sorted(os.environ), ranks=[0], stream=False)[0]
    assert "PMI_RANK" in engine_env  # what the script must not inherit
    script = tmp_path / "hello_mpi.py"
    script.write_text(MPI_SCRIPT)
    shell.run_line_magic("axon_run", str(script))
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert (
            f"[rank {rank}] mpi size=1 leaked=[] GROUP_RANK=0 ROLE_RANK={rank} ROLE_WORLD_SIZE=2 "
            "LOCAL_WORLD_SIZE=2 OMP_NUM_THREADS=1"
        ) in out


def test_axon_run_reports_a_failing_rank_and_a_missing_script(shell, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such script"):
        shell.run_line_magic("axon_run", str(tmp_path / "nope.py"))
    script = tmp_path / "fails.py"
    script.write_text(TORCHRUN_SCRIPT)
    _cluster(shell).execute("import os; os.environ['FAIL_ON_RANK'] = '1'", stream=False)
    try:
        with pytest.raises(axon_nb.RankError, match=r"rank 1 raised ScriptError.*status 3"):
            shell.run_line_magic("axon_run", str(script))
    finally:
        _cluster(shell).execute("del os.environ['FAIL_ON_RANK']", stream=False)


def test_axon_status_and_axon_dashboard_show_the_ranks_and_the_latest_run(shell, capsys) -> None:
    from models import make_data, make_mlp, mse

    from axon_nb.widgets.status import status_widget

    with pytest.raises(UsageError, match="no training run yet"):
        shell.run_line_magic("axon_dashboard", "")
    cluster = axon_nb.current_cluster()
    assert cluster is _cluster(shell)
    cluster.train(model=make_mlp, data=make_data, loss=mse, steps=3, batch_size=16, name="shown")
    shell.run_line_magic("axon_dashboard", "")
    assert cluster.last_run is not None and cluster.last_run.shown
    capsys.readouterr()
    shell.run_line_magic("axon_status", "")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["rank", "host", "device", "backend", "memory", "training", "runs"]
    assert lines[1].startswith("0") and lines[2].startswith("1")
    assert "MiB RSS" in lines[1] and "shown @ step 3" in lines[2]
    from axon_nb.rank.observe.rank_status import rank_status

    widget = status_widget(cluster.run(rank_status, stream=False))
    assert widget.value.count("<tr>") == 3 and "shown @ step 3" in widget.value


def test_axon_bench_prints_nccl_tests_figures_and_refuses_bad_input(shell, capsys) -> None:
    capsys.readouterr()
    shell.run_line_magic("axon_bench", "all_reduce --sizes 1K:4K --iters 2 --warmup 1")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["collective", "axis", "ranks", "size", "time", "algbw", "busbw"]
    assert [line.split()[3] for line in lines[1:]] == ["1K", "2K", "4K"]
    assert _cluster(shell).bandwidth_results is not None
    with pytest.raises(UsageError, match=r"unknown collective\(s\) \['all_sum'\]"):
        shell.run_line_magic("axon_bench", "all_sum")
    with pytest.raises(UsageError, match="sizes must be between 4 bytes and 8G"):
        shell.run_line_magic("axon_bench", "all_reduce --sizes 1K:16G")
    with pytest.raises(UsageError, match="cannot read size 'lots'"):
        shell.run_line_magic("axon_bench", "all_reduce --sizes 1K:lots")


def test_status_restart_and_stop(shell, capsys) -> None:
    old = [r["pid"] for r in _cluster(shell).ranks]
    shell.run_line_magic("axon_cluster", "--status")
    assert "n=2" in capsys.readouterr().out
    shell.run_line_magic("axon_cluster", "--restart")
    assert set(r["pid"] for r in _cluster(shell).ranks).isdisjoint(old)
    shell.run_line_magic("axon_cluster", "--stop")
    assert "Stopped the cluster (2 ranks)" in capsys.readouterr().out
    shell.run_line_magic("axon_cluster", "--status")
    assert "No cluster is running" in capsys.readouterr().out


def _cluster(shell) -> axon_nb.Cluster:
    magics = shell.magics_manager.registry["AxonMagics"]
    assert magics.cluster is not None
    return magics.cluster
