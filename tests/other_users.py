"""Other users of this machine for security tests: a cluster's owner who is not root, and a
stranger (``nobody``), each running the system's Python with this project's environment on
``PYTHONPATH`` (the venv's own python lives in root's home, which they cannot enter; both are
CPython 3.11, so the venv's compiled packages load).

    env = user_env(home)                       # for the owner, whose home is ``home``
    subprocess.run(as_user("nobody", ["python3", "probe.py"]), env=user_env(...))
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OWNER = "daemon"
"""The cluster's owner in these tests: an unprivileged account every Debian has."""
STRANGER = "nobody"
SYSTEM_PYTHON = "/usr/bin/python3"


def missing() -> str | None:
    """Why other users cannot be tested here, or None."""
    if os.geteuid() != 0:
        return "needs root (to run as other users)"
    if shutil.which("runuser") is None:
        return "needs runuser"
    if not os.path.exists(SYSTEM_PYTHON):
        return f"needs {SYSTEM_PYTHON}"
    version = os.popen(f"{SYSTEM_PYTHON} -c 'import sys; print(sys.version_info[:2])'").read()
    if version.strip() != str(tuple(sys.version_info[:2])):
        return f"{SYSTEM_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]}"
    if not os.access(sys.prefix, os.R_OK | os.X_OK) or (os.stat(REPO).st_mode & 0o005) != 0o005:
        return "the project's environment is not readable by other users"
    return None


def user_env(home: str | Path) -> dict[str, str]:
    """A clean environment running the system Python on this project's packages."""
    site = sysconfig.get_paths()["purelib"]
    return {
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "PYTHONPATH": f"{REPO}:{REPO / 'tests'}:{site}",
        "LD_LIBRARY_PATH": str(Path(sys.prefix) / "lib"),  # MPICH's libmpi for mpi4py
        "AXON_NB_WARM_ENGINES": os.environ.get("AXON_NB_WARM_ENGINES", "1"),
        "LANG": "C.UTF-8",
    }


def as_user(user: str, argv: list[str]) -> list[str]:
    """``argv`` run as ``user`` (``runuser -m`` keeps the environment it is given, HOME
    included)."""
    return [shutil.which("runuser") or "runuser", "-m", "-u", user, "--", *argv]


def probe_as_stranger(ports: list[tuple[str, int]], canary: Path, netns: str | None = None) -> dict:
    """What the stranger got from each port (``tests/foreign_probe.py``)."""
    request = json.dumps({"ports": ports, "canary": str(canary), "seconds": 1.5})
    argv = as_user(STRANGER, [SYSTEM_PYTHON, str(REPO / "tests" / "foreign_probe.py"), request])
    if netns is not None:
        argv = [shutil.which("ip") or "ip", "netns", "exec", netns, *argv]
    done = subprocess.run(
        argv, env=user_env("/nonexistent"), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = dict(json.loads(done.stdout.strip().splitlines()[-1]))
    if os.environ.get("AXON_NB_PROBE_REPORTS"):  # a folder: keep each report (for the issue)
        name = f"probe-{netns or 'local'}-{time.time_ns()}.json"
        Path(os.environ["AXON_NB_PROBE_REPORTS"], name).write_text(json.dumps(report, indent=1))
    return report


def assert_nothing_got(report: dict, marker: str) -> None:
    """No port ran the stranger's code or showed them anything."""
    assert report.pop("canary_exists") is False, "a stranger's code ran"
    text = json.dumps(report)
    assert marker not in text and marker.encode().hex() not in text, "a stranger read output"
    for where, entry in report.items():
        assert all(isinstance(entry[step], dict) for step in ("zmq", "dask", "http")), entry
        assert entry["zmq"]["bytes"] == 0, (where, entry["zmq"])
        for scheme, outcome in entry["dask"].items():
            assert outcome.startswith("refused"), (where, scheme, outcome)
        ok = {route: s for route, s in entry["http"].items() if s.startswith("2")}
        assert ok == {}, (where, ok)


def print_marker(marker: str, seconds: float) -> None:
    """On a rank: print and publish ``marker`` ten times a second for ``seconds``, from a
    thread, so that the engine's event loop (which the rank's dask worker shares) stays free
    to answer a probe."""
    import threading

    from ipyparallel.datapub import publish_data

    def loop() -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            print(marker, flush=True)
            publish_data({"marker": marker})
            time.sleep(0.1)

    threading.Thread(target=loop, daemon=True).start()
