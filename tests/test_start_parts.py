"""Parts of a start, without a cluster: the warm process's imports
(``rank/world/engine_server.py``), the nanny a forked engine forks
(``rank/world/forked_nanny.py``; with a cluster in test_warm_engines.py) and the wait for
engines waking as each registers (``cluster/startup.py``)."""

from __future__ import annotations

import subprocess
import sys
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import wait_gone

from axon_nb.cluster import startup
from axon_nb.cluster.options import ClusterOptions

pytestmark = pytest.mark.timeout(60)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )


def test_the_warm_process_freezes_what_it_imports_for_the_engines_it_forks() -> None:
    """Imported with the collector off, then frozen: an engine forked afterwards finds none of
    those objects for its collections to walk, and its collector on (as it is in a new
    Python)."""
    out = _python(
        "import gc, os\n"
        "from axon_nb.rank.world import engine_server\n"
        "engine_server._preload()\n"
        "assert gc.isenabled()\n"
        "frozen = gc.get_freeze_count()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if gc.isenabled() and len(gc.get_objects()) < 1000 else 1)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(frozen, os.waitstatus_to_exitcode(status))\n"
    )
    frozen, child = map(int, out.stdout.split())
    assert frozen > 100_000 and child == 0  # (torch alone is 150,000 objects)


def test_the_waiting_child_ends_with_an_engine_that_never_asked() -> None:
    out = _python(
        "import ipyparallel.engine.nanny\n"
        "from axon_nb.rank.world.forked_nanny import ForkedNanny\n"
        "print(ForkedNanny.fork().pid)\n"
    )
    assert wait_gone([int(out.stdout)], 10) == []


def test_a_child_that_is_gone_leaves_the_nanny_to_ipyparallel() -> None:
    """The fork made it, the child died before the engine asked (the OOM killer, say): the
    engine starts ipyparallel's nanny as a process instead of failing its start."""
    out = _python(
        "import os, signal, time\n"
        "import ipyparallel.engine.app as app\n"
        "from axon_nb.rank.world.forked_nanny import ForkedNanny\n"
        "calls = []\n"
        "app.start_nanny = lambda **kw: calls.append(kw) or ('tcp://127.0.0.1:1', 'pipe')\n"
        "nanny = ForkedNanny.fork()\n"
        "nanny.replace_ipyparallel_start()\n"
        "os.kill(nanny.pid, signal.SIGKILL)\n"
        "time.sleep(0.2)\n"
        "print(app.start_nanny(engine_id=3, control_url='tcp://127.0.0.1:2'))\n"
        "print(calls)\n"
        "print(os.path.exists(f'/proc/{nanny.pid}'))\n"  # reaped, not a zombie
    )
    assert out.stdout.splitlines() == [
        "('tcp://127.0.0.1:1', 'pipe')",
        "[{'engine_id': 3, 'control_url': 'tcp://127.0.0.1:2'}]",
        "False",
    ]
    assert "the forked nanny failed; starting it as a process" in out.stderr


def test_a_plain_engine_process_leaves_the_nanny_to_ipyparallel() -> None:
    out = _python(
        "from axon_nb.rank.world.forked_nanny import ForkedNanny\nprint(ForkedNanny.fork())\n"
    )
    assert out.stdout.strip() == "None"


class _Client:
    """What the wait reads of ipyparallel's client: its engine ids and registration hooks."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._registration_callbacks: list[Any] = []

    def register(self, engine_id: int) -> None:  # (as the client's IO thread does)
        self.ids = [*self.ids, engine_id]
        for callback in self._registration_callbacks:
            callback({"event": "register", "id": engine_id})


def test_the_wait_for_engines_goes_on_as_each_registers(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the wait's own poll put at 10 minutes, only the registrations can end it."""
    monkeypatch.setattr(startup, "POLL_S", 600.0)
    controller = SimpleNamespace(state="running", output_file="")
    cluster = SimpleNamespace(controller=controller, engines={})
    client = _Client()
    options = ClusterOptions(n=2, engines="local")
    for delay, engine_id in ((0.2, 0), (0.4, 1)):
        threading.Timer(delay, client.register, (engine_id,)).start()
    startup.wait_for_engines(cluster, client, options)  # type: ignore[arg-type]
    assert client.ids == [0, 1]
    assert client._registration_callbacks == []  # its hook taken off again


@pytest.mark.parametrize(
    "error",
    [
        startup.ClusterStartError("the controller failed while starting"),  # its traceback seen
        startup.ClusterStartError(startup.PORT_TAKEN_WHY),  # its last line seen
        TimeoutError("no answer"),
    ],
    ids=["traceback", "port-line", "other"],
)
def test_a_start_that_lost_a_port_says_so_once_however_it_was_seen(error: Exception) -> None:
    """Run 11: the controller's traceback was read before its last line (the taken port) was
    written; the port race was found after, and the error that ended the start did not say
    it."""
    raised = startup.start_error(error, True, None)
    assert isinstance(raised, startup.PortRace)
    assert str(raised).count(startup.PORT_TAKEN_WHY) == 1
