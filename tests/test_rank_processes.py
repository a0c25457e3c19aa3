"""The rank processes a start watches are found by walking the process table until all are
known, then by their pids alone (real processes shaped like MPI's: launcher, rank parent,
engine)."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import psutil
import pytest
from helpers import until, wait_gone

from axon_nb.cluster.rank_processes import RankProcesses
from axon_nb.cluster.stopping import RANK_PARENT

pytestmark = pytest.mark.timeout(60)

# A launcher with two ranks: each rank parent (its command line names RANK_PARENT, as
# rank/world/launch.py's does) runs one engine that sleeps.
_ENGINE = "import time; time.sleep(60)"
_PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_ENGINE!r}])"
_RANK = f"[sys.executable, '-c', {_PARENT!r}, {RANK_PARENT!r}]"
_LAUNCHER = (
    "import subprocess, sys\n"
    f"ps = [subprocess.Popen({_RANK}) for _ in range(2)]\n"
    "[p.wait() for p in ps]"
)


def test_parents_and_engines_are_found_then_followed_by_pid() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER])
    try:
        ranks = RankProcesses(lambda: [launcher.pid], n=2)
        assert until(lambda: len(ranks.poll()[1]) == 2, 30)
        parents, engines = ranks.poll()
        # (an engine forked but not yet exec'd still has its parent's command line: the
        # launcher's children are the parents, theirs the engines)
        below = psutil.Process(launcher.pid).children()
        assert sorted(parents) == sorted(p.pid for p in below)
        assert engines == {c.pid for p in below for c in p.children()}
        # all known, a poll follows their pids: it sees an engine end
        scans = []
        ranks._scan = lambda: scans.append(1)  # type: ignore[method-assign]
        victim = min(engines)
        psutil.Process(victim).kill()
        assert until(lambda: ranks.poll()[1] == engines - {victim}, 10)
        assert until(lambda: len(ranks.poll()[0]) == 1, 10)  # its parent ended with it
        assert scans == []  # no walk of the process table once all were found
    finally:
        for proc in psutil.Process(launcher.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                proc.kill()
        launcher.kill()
        launcher.wait()
        assert wait_gone([launcher.pid]) == []
