"""Engines forked from the kernel's warm process (``cluster/warm_engines.py``): each start
gets fresh engines in its own environment, a rank's parent that dies takes its forked engine
along, and without the server (switched off, or not answering) engines start as processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import until, wait_gone

import axon_nb
from axon_nb.cluster import warm_engines
from axon_nb.cluster.stopping import forked_engine, is_rank_parent
from axon_nb.rank.world.forked_engine import ENGINE_MODULE, ForkedEngine
from axon_nb.spec.warm_engines import SERVER_ENV, SWITCH_ENV, socket_path

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.usefixtures("no_pooled_clusters"),  # each test starts without a server
    pytest.mark.timeout(300),
]


def _engine_facts() -> dict:
    import os
    import sys

    import numpy as np

    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "log": os.environ.get("AXON_NB_ENGINE_LOG"),
        "cwd": os.getcwd(),
        "main": sys.argv[0],
        "draw": float(np.random.rand()),
    }


def _rank_parent(engine: int) -> psutil.Process:
    """The rank parent the server forked ``engine`` for (``cluster/stopping.py`` finds it so)."""
    # (mpiexec's command line names the rank parent's module too: it has no engine)
    parents = [p for p in psutil.Process().children(recursive=True) if is_rank_parent(p)]
    found = [p for p in parents if (e := forked_engine(p)) is not None and e.pid == engine]
    assert len(found) == 1, (engine, parents)
    return found[0]


def _forked_facts(cluster: axon_nb.Cluster, server: int) -> list[dict]:
    """Each engine's facts, checked against what a child of its rank parent would have."""
    facts = cluster.run(_engine_facts, stream=False)
    for f in facts:
        assert f["ppid"] == server  # forked by the server
        assert f["cwd"] == _rank_parent(f["pid"]).cwd()
        assert f["main"].endswith("axon_nb/rank/world/engine.py")
    assert len({f["draw"] for f in facts}) == len(facts)  # numpy reseeded in each engine
    return facts


def test_each_start_forks_fresh_engines_in_its_own_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = axon_nb.Cluster(n=2).start()
    try:
        server = warm_engines.server_pid()
        assert server is not None
        first = _forked_facts(cluster, server)
        cluster.restart()
        assert warm_engines.server_pid() == server  # a restart keeps it
        second = _forked_facts(cluster, server)
        assert wait_gone([f["pid"] for f in first], 10) == []
        assert first[0]["log"] != second[0]["log"]  # each start's own environment
        assert "RuntimeWarning" not in cluster.log.path.read_text()  # type: ignore[union-attr]
        assert {f["draw"] for f in first}.isdisjoint(f["draw"] for f in second)
        # a second cluster of the kernel forks from the same server; stopping it keeps the
        # server for the first one's sake
        with axon_nb.Cluster(n=2) as other:
            _forked_facts(other, server)
        assert warm_engines.server_pid() == server
        assert cluster.run(lambda: 1, stream=False) == [1, 1]
        # a setting read as torch loads: the next start's engines come from a new server
        monkeypatch.setenv("OMP_AXON_TEST", "1")
        cluster.restart()
        assert warm_engines.server_pid() not in (None, server)
        assert wait_gone([server], 10) == []
        server = warm_engines.server_pid()
        _forked_facts(cluster, server)
    finally:
        cluster.stop()
    assert warm_engines.server_pid() is None  # the last stop ends it
    assert wait_gone([server], 1) == []


def _has_dynamo() -> bool:
    import sys

    return "torch._dynamo" in sys.modules


def test_an_idle_server_imports_what_engines_import_later() -> None:
    """torch._dynamo (a second of CPU in every engine that runs DDP or FSDP) comes with the
    fork once the server has been idle: not into the first start's engines, which it would
    slow down, but into every later one's."""
    from axon_nb.rank.world.engine_server import LATER_IMPORTS_IDLE_S

    with axon_nb.Cluster(n=2) as cluster:
        assert cluster.run(_has_dynamo, stream=False) == [False, False]
        time.sleep(LATER_IMPORTS_IDLE_S + 1.0)
        cluster.restart()
        assert cluster.run(_has_dynamo, stream=False) == [True, True]
        # and they train as before: DDP's first use of dynamo is in the forked engine
        assert cluster.run(_ddp_step, stream=False) == [1.0, 1.0]


def _ddp_step() -> float:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(2, 1))
    model(torch.ones(4, 2)).sum().backward()
    return float(model.module.bias.grad.item() / 4)


def test_a_bad_request_ends_nothing_and_a_rank_ends_as_under_its_parent() -> None:
    with axon_nb.Cluster(n=2, timeout=30) as cluster:
        engines = [r["pid"] for r in cluster.ranks]
        server = warm_engines.server_pid()
        assert {psutil.Process(pid).ppid() for pid in engines} == {server}
        directory = _rank_parent(engines[0]).environ()[SERVER_ENV]
        # requests the server refuses: it and every engine go on
        for request in (b"{}\n", b"not json\n", b'{"fd_numbers": [0, 1]}\n'):
            with socket.socket(socket.AF_UNIX) as conn:
                conn.connect(socket_path(directory))
                conn.sendall(request)
                assert conn.recv(100) == b""  # closed, no engine forked
        assert cluster.run(lambda: 1, stream=False) == [1, 1]
        assert warm_engines.server_pid() == server
        # an engine killed: its parent learns how it ended (from the server, which reaped
        # it), and keeps the rank's MPI slot until the stop, as for an engine of its own
        parent = _rank_parent(engines[0])
        os.kill(engines[0], signal.SIGKILL)
        assert wait_gone([engines[0]], 10) == []
        time.sleep(1.0)
        assert parent.is_running() and psutil.pid_exists(engines[1])
        log = cluster.log.path  # type: ignore[union-attr]
        said = f"the engine of this rank (pid {engines[0]}) was killed by signal 9 (SIGKILL)"
        assert said in log.read_text()  # (written to the log by the parent, at once)
        # a rank's parent killed (as the OOM killer might): its engine goes with it (MPI's
        # process manager then ends the rest)
        victim = engines[1]
        _rank_parent(victim).kill()
        assert wait_gone([victim], 10) == []


def _links(pid: int) -> set[str]:
    """What ``pid``'s file descriptors point to (``socket:[inode]`` for a socket)."""
    fds = Path(f"/proc/{pid}/fd")
    return {os.readlink(fd) for fd in fds.iterdir() if fd.exists()}


def test_a_forked_engine_forks_its_nanny() -> None:
    """ipyparallel starts each engine's nanny as a new Python (0.27 CPU-s and 0.25 s of every
    start); a forked engine forks it (``rank/world/forked_nanny.py``). It is still the engine's
    child, in a session of its own, holds none of the engine's descriptors (MPI's connection
    among them), passes the controller's signals on, and ends with its engine."""
    with axon_nb.Cluster(n=2, timeout=30) as cluster:
        engines = [psutil.Process(r["pid"]) for r in cluster.ranks]
        nannies = [engine.children() for engine in engines]
        assert [len(children) for children in nannies] == [1, 1]
        for engine, (nanny,) in zip(engines, nannies, strict=True):
            assert nanny.cmdline() == engine.cmdline()  # forked, not a new Python
            assert os.getsid(nanny.pid) == nanny.pid != os.getsid(engine.pid)
            number = _rank_parent(engine.pid).environ()["PMI_FD"]  # (the engine's, at its number)
            pmi = os.readlink(f"/proc/{engine.pid}/fd/{number}")
            assert pmi.startswith("socket:") and pmi not in _links(nanny.pid)
        replies = cluster.client.send_signal(signal.SIGCONT, targets=[0, 1], block=False)
        assert [m["content"]["status"] for m in replies.result(timeout=10)] == ["ok", "ok"]
        engines[0].kill()
        assert wait_gone([engines[0].pid, nannies[0][0].pid], 10) == []
        assert until(lambda: cluster.client.ids == [1], 10)  # the nanny told the controller


def test_switched_off_engines_are_children_of_their_rank_parents(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SWITCH_ENV, "0")
    with axon_nb.Cluster(n=2) as cluster:
        for pid in (r["pid"] for r in cluster.ranks):
            assert is_rank_parent(psutil.Process(pid).parent())


def test_a_server_that_does_not_answer_leaves_the_engine_to_a_process(tmp_path: Path) -> None:
    command = [sys.executable, "-m", ENGINE_MODULE, "--mpi"]
    assert ForkedEngine.start(str(tmp_path), command, None) is None  # no socket
    # a socket no process listens on any more
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(tmp_path / "engines.sock"))
    dead.close()
    assert ForkedEngine.start(str(tmp_path), command, None) is None
    # another command is never sent to the server
    assert ForkedEngine.start(str(tmp_path), [sys.executable, "-c", "pass"], None) is None


def test_the_server_ends_with_the_kernel_and_takes_its_engines(tmp_path: Path) -> None:
    """SIGKILL of a kernel whose cluster runs a cell: the server, its engines and everything
    else that kernel started are gone within 15 s (the README's promise)."""
    script = tmp_path / "kernel.py"
    script.write_text(
        "import time, axon_nb\n"
        "from axon_nb.cluster import warm_engines\n"
        "cluster = axon_nb.Cluster(n=2, timeout=30).start()\n"
        "cluster.send(time.sleep, 600)\n"
        f"open({str(tmp_path / 'up')!r}, 'w').write(str(warm_engines.server_pid()))\n"
        "time.sleep(600)\n"
    )
    kernel = psutil.Popen([sys.executable, str(script)], cwd=tmp_path)
    everything: list[int] = []
    try:
        assert until(lambda: (tmp_path / "up").exists() or kernel.poll() is not None, 180)
        assert kernel.poll() is None
        server = int((tmp_path / "up").read_text())
        assert until(lambda: len(psutil.Process(server).children()) == 2, 30)
        everything = [p.pid for p in kernel.children(recursive=True)]
        assert server in everything
        os.kill(kernel.pid, signal.SIGKILL)
        kernel.wait()
        assert wait_gone(everything, 15) == []
    finally:
        for pid in [*everything, kernel.pid]:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def test_a_server_that_fails_leaves_engines_to_processes_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that dies (here: right after it listens) costs nothing but speed: each rank's
    parent starts its engine as a process, and the next start warns once, with its output."""
    failing = (
        "import socket, sys; s = socket.socket(socket.AF_UNIX); "
        "s.bind(sys.argv[1] + '/engines.sock'); print('no torch here'); sys.exit(3)"
    )
    monkeypatch.setattr(warm_engines, "SERVER_CMD", [sys.executable, "-c", failing])
    monkeypatch.setattr(warm_engines, "_failed", False)
    assert warm_engines.server_pid() is None
    with (
        pytest.warns(RuntimeWarning, match="(?s)engines start as new processes.*no torch here"),
        axon_nb.Cluster(n=2) as cluster,
    ):
        assert cluster.run(lambda: 1, stream=False) == [1, 1]
        for pid in (r["pid"] for r in cluster.ranks):
            assert is_rank_parent(psutil.Process(pid).parent())
    assert warm_engines.server_directory() is None  # once failed, not tried again
