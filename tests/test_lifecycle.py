"""Starting faults leave nothing behind, and engines never outlive the process that started them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import cluster_pids, wait_gone

import axon_nb

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.usefixtures("no_pooled_clusters"),
    pytest.mark.timeout(180),
]


def _descendants() -> set[int]:
    return set(cluster_pids())


def test_missing_mpiexec_says_how_to_install_it(monkeypatch) -> None:
    import ipyparallel.cluster.launcher  # noqa: F401  (its defaults read sys.executable once)

    monkeypatch.setattr(sys, "executable", "/nonexistent/bin/python")
    monkeypatch.setenv("PATH", "/nonexistent")
    before = _descendants()
    with pytest.raises(axon_nb.ClusterStartError, match="pip install mpich"):
        axon_nb.Cluster(n=2).start()
    assert _descendants() <= before


def test_nccl_without_gpus_stops_everything() -> None:
    with pytest.raises(axon_nb.ClusterStartError, match="nccl needs one GPU per rank"):
        axon_nb.Cluster(n=2, backend="nccl").start()
    assert wait_gone(list(_descendants())) == []


def test_a_rank_dying_during_start_is_reported_and_cleaned_up(tmp_path: Path, monkeypatch) -> None:
    # Real fault injection: rank 1's interpreter exits while starting (MPICH sets PMI_RANK).
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('PMI_RANK') == '1':\n    os._exit(3)\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cluster = axon_nb.Cluster(n=2, start_timeout=60)
    with pytest.raises(axon_nb.ClusterStartError, match="a rank exited while starting"):
        cluster.start()  # at once, not after the start timeout
    assert not cluster.running
    assert wait_gone(list(_descendants())) == []


STARTER = textwrap.dedent(
    """
    import json, sys, time
    import axon_nb

    cluster = axon_nb.Cluster(n=2, timeout=60).start()
    ipp = cluster._ipp
    pids = [r["pid"] for r in cluster.ranks] + [ipp.controller.process.pid]
    pids += [es.process.pid for es in ipp.engines.values()]
    watch = str(cluster._watch.path)
    print(json.dumps({"pids": pids, "torch": "torch" in sys.modules, "watch": watch}), flush=True)
    if sys.argv[1] == "wait":
        time.sleep(600)
    """
)


@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_engines_and_controller_never_outlive_their_starter(tmp_path: Path, ending: str) -> None:
    script = tmp_path / "starter.py"
    script.write_text(STARTER)
    mode = "wait" if ending == "sigkill" else "exit"
    proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        report = json.loads(proc.stdout.readline())
        assert report["torch"] is False  # the starting process never imports torch (nor CUDA)
        if ending == "sigkill":
            proc.send_signal(signal.SIGKILL)  # no atexit: the reaper must clean up
        proc.wait(timeout=60)
        assert wait_gone(report["pids"], seconds=30) == []
        deadline = time.monotonic() + 10  # the reaper removes the stack-request directory too
        while os.path.exists(report["watch"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(report["watch"])
    finally:
        proc.kill()


def _controller_paused_until_an_engine_gives_up(monkeypatch) -> None:
    """Every start's controller is stopped (SIGSTOP) as its engines are launched, and let go
    once one of them logged that it gave up registering (at most 30 s): no answer can come in
    time however the engines' threads are scheduled. (A registration timeout of
    0.1 ms alone was not enough: an engine's main thread, descheduled between its request
    and its poll, found the answer already there on CI.)"""
    import ipyparallel as ipp

    from axon_nb.cluster.startup import GAVE_UP

    start_engines = ipp.Cluster.start_engines

    def resume_when_given_up(pid: int, log: str) -> None:
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    if GAVE_UP in Path(log).read_text(errors="replace"):
                        return
                time.sleep(0.1)
        finally:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)

    async def paused_start(self: ipp.Cluster, *args: Any, **kwargs: Any) -> Any:
        await self.controller.get_connection_info()  # (written by the controller, running)
        pid = self.controller.process.pid
        log = self.config.MPIEngineSetLauncher.environment["AXON_NB_ENGINE_LOG"]
        os.kill(pid, signal.SIGSTOP)
        threading.Thread(target=resume_when_given_up, args=(pid, log), daemon=True).start()
        return await start_engines(self, *args, **kwargs)

    monkeypatch.setattr(ipp.Cluster, "start_engines", paused_start)


def test_an_engine_that_gives_up_registering_fails_the_start_at_once(monkeypatch) -> None:
    """The mechanism of the "0 of N engines connected" flake: an engine whose registration
    timed out stays alive and never connects. Now the start fails in seconds and says so."""
    from axon_nb.cluster import launchers

    monkeypatch.setattr(launchers, "ENGINE_ARGS", ["--IPEngine.timeout=0.5"])
    _controller_paused_until_an_engine_gives_up(monkeypatch)
    before = _descendants()
    started = time.monotonic()
    with pytest.raises(axon_nb.ClusterStartError, match="gave up registering"):
        axon_nb.Cluster(n=2, start_timeout=60).start()
    assert time.monotonic() - started < 30
    assert wait_gone(list(_descendants() - before)) == []


def test_a_rank_that_exits_while_starting_fails_the_start_naming_the_log(monkeypatch) -> None:
    from axon_nb.cluster import launchers

    monkeypatch.setattr(launchers, "ENGINE_ARGS", ["--no-such-engine-option"])
    before = _descendants()
    started = time.monotonic()
    with pytest.raises(axon_nb.ClusterStartError, match="a rank exited while starting") as info:
        axon_nb.Cluster(n=2, start_timeout=60).start()
    assert time.monotonic() - started < 30
    assert "The cluster's log (" in str(info.value)  # where the engine's own words are
    assert wait_gone(list(_descendants() - before)) == []


def _hold_a_port_the_controller_binds_late(monkeypatch) -> socket.socket:
    """Make certain the race a controller can lose on a busy host: its ports are picked free
    and bound a moment later, its broadcast schedulers' internal ports after it has written its
    connection file. Here the engines' and clients' ports are free ones and the first internal
    port is one this test holds (ipyparallel hands them out in that order)."""
    from axon_nb.cluster import cluster as cluster_module

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    probes = [socket.socket() for _ in range(16)]
    for probe in probes:
        probe.bind(("127.0.0.1", 0))
    free = [probe.getsockname()[1] for probe in probes]
    for probe in probes:
        probe.close()
    args = [
        *cluster_module.CONTROLLER_ARGS,
        "--IPController.engine_ports=" + ",".join(map(str, free[:9])),
        "--IPController.client_ports=" + ",".join(map(str, free[9:])),
        f"--IPController.ports={held.getsockname()[1]}",
    ]
    monkeypatch.setattr(cluster_module, "CONTROLLER_ARGS", args)
    return held


def test_a_controller_that_lost_a_port_fails_the_start_at_once(monkeypatch) -> None:
    """Seen in a full run: the controller exited ("Address already in use") after writing its
    connection file, and the start waited out its 120 s for an answer. Now each try fails as
    soon as the controller exits, the start is tried again, and the last error says why."""
    held = _hold_a_port_the_controller_binds_late(monkeypatch)
    before = _descendants()
    started = time.monotonic()
    try:
        with pytest.raises(
            axon_nb.ClusterStartError,
            match="a port the controller picked was taken before it bound it",
        ):
            axon_nb.Cluster(n=2, start_timeout=120).start()
    finally:
        held.close()
    assert time.monotonic() - started < 60  # three tries, none waits for the timeout
    assert wait_gone(list(_descendants() - before)) == []


def test_a_start_whose_controller_lost_a_port_is_tried_again(monkeypatch) -> None:
    from axon_nb.cluster import cluster as cluster_module
    from axon_nb.cluster import startup

    own_ports = cluster_module.CONTROLLER_ARGS
    held = _hold_a_port_the_controller_binds_late(monkeypatch)
    seen = startup.port_was_taken
    tries = []

    def free_the_port_once_it_was_lost(*args: object) -> bool:
        taken = seen(*args)  # type: ignore[arg-type]
        tries.append(taken)
        held.close()
        # The next try picks new ports, as a real one does: the ports pinned for the first
        # try were free when probed, and another test's start may have one of them by now.
        monkeypatch.setattr(cluster_module, "CONTROLLER_ARGS", own_ports)
        return taken

    monkeypatch.setattr(startup, "port_was_taken", free_the_port_once_it_was_lost)
    with axon_nb.Cluster(n=2, start_timeout=120) as cluster:
        assert cluster.run(lambda: 1, stream=False) == [1, 1]
    assert tries == [True]  # the first try lost the port; the second started


def test_a_traceback_still_being_written_is_read_to_its_end(tmp_path) -> None:
    """Seen in two full runs: the start took the controller's half-written traceback for the
    whole of it, missed the "Address already in use" line that came after, and failed instead
    of trying again. Here a process writes a traceback in parts 2 s apart (a wait for quiet
    output read only the first), with another thread's log line between them."""
    import subprocess

    from axon_nb.cluster import startup

    out = tmp_path / "controller.out"
    writer = subprocess.Popen([
        sys.executable, "-c",
        "import sys, time\n"
        f"f = open({str(out)!r}, 'w')\n"
        "f.write('Traceback (most recent call last):\\n  File \"app.py\"\\n'); f.flush()\n"
        "time.sleep(2.0)\n"
        "f.write('2026-11-27 08:17:30,595 INFO Stopping controller\\n'); f.flush()\n"
        "time.sleep(2.0)\n"
        "f.write('    util.bind(out, out_addr)\\n    ^^^^^^^^\\n'); f.flush()\n"
        "f.write('zmq.error.ZMQError: Addr'); f.flush()\n"
        "time.sleep(1.0)\n"
        "f.write('ess already in use\\n'); f.flush()\n",
    ])  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "Traceback" not in (out.read_text() if out.exists() else ""):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert startup.PORT_TAKEN not in out.read_text()  # only the first part so far
        text = startup.finished_traceback(out.read_text, 30)
        assert startup.PORT_TAKEN in text
    finally:
        writer.wait(timeout=30)
