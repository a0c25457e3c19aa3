"""No one else gets in: a cluster owned by an unprivileged user (home 0755), probed by another
uid (``nobody``) on the same machine, runs nothing of theirs and shows them nothing.

The owner is Debian's ``daemon`` account, so every file and port of the cluster is found by its
uid, not by a list of ours; both users run the system's Python on this project's packages
(``tests/other_users.py``). The probe is ``tests/foreign_probe.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from other_users import (
    OWNER,
    STRANGER,
    SYSTEM_PYTHON,
    as_user,
    assert_nothing_got,
    missing,
    probe_as_stranger,
    user_env,
)
from owned_cluster import PREFIX

import axon_nb
from axon_nb.cluster.dask_tls import CertificateError
from axon_nb.cluster.ports import PORTS, describe_ports, role_of

HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
needs_users = pytest.mark.skipif(missing() is not None, reason=f"other users: {missing()}")


class Owned:
    """The owner's cluster process (``tests/owned_cluster.py``) and what it said."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.uid = pwd.getpwnam(OWNER).pw_uid
        self.proc = subprocess.Popen(
            as_user(OWNER, [SYSTEM_PYTHON, str(HERE / "owned_cluster.py")]),
            env=user_env(home),
            cwd=home,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self.ask(None, timeout=180)

    def ask(self, command: str | None, timeout: float = 60) -> dict[str, Any]:
        """Send ``command`` (if any) and read the one JSON line it answers."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        stdout = self.proc.stdout
        answer: list[str] = []

        def read() -> None:
            for line in stdout:
                if line.startswith(PREFIX):
                    answer.append(line.removeprefix(PREFIX))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        assert answer, f"the owner's cluster did not answer {command!r}"
        return dict(json.loads(answer[0]))

    def processes(self) -> list[psutil.Process]:
        """Every process of the owner (the cluster's: the account runs nothing else)."""
        return [p for p in psutil.process_iter(["uids"]) if p.info["uids"].real == self.uid]

    def close(self) -> None:
        try:
            self.ask("stop", timeout=60)
        finally:
            self.proc.kill()
            self.proc.wait(10)
            # What the stop leaves is still on its way out: wait, then kill the rest.
            _, alive = psutil.wait_procs(self.processes(), timeout=10)
            for p in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()


HOME_PREFIX = "axon-owner-home-"
"""The owner's home for the test, in the temporary directory, 0755 as homes are."""


@pytest.fixture(scope="module")
def other_users_cluster() -> Iterator[Owned]:
    if missing() is not None:
        pytest.skip(f"other users: {missing()}")
    home = Path(tempfile.mkdtemp(prefix=HOME_PREFIX))
    os.chmod(home, 0o755)
    shutil.chown(home, OWNER, OWNER)
    cluster = Owned(home)
    try:
        yield cluster
    finally:
        cluster.close()
        shutil.rmtree(home, ignore_errors=True)


def _listening(processes: list[psutil.Process]) -> dict[tuple[str, int], str]:
    """(address, port) -> the command of the process listening there."""
    found = {}
    for proc in processes:
        try:
            command = " ".join(proc.cmdline())
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                found[(c.laddr.ip, c.laddr.port)] = command
    return found


@needs_users
def test_a_stranger_runs_nothing_and_reads_nothing_on_any_port(other_users_cluster: Owned) -> None:
    assert (
        other_users_cluster.ask("busy 30")["busy"] == 30
    )  # the ranks print and publish the marker
    listening = _listening(other_users_cluster.processes())
    dask_port = int(other_users_cluster.info["dask"].rsplit(":", 1)[1])
    assert ("127.0.0.1", dask_port) in listening  # the probe reaches the scheduler itself
    roles = {address: role_of(command) for address, command in listening.items()}
    assert None not in roles.values(), {a: listening[a] for a, r in roles.items() if r is None}
    inventory = {(port.process, port.speaks) for port in PORTS}
    assert {r for r in roles.values()} <= {p for p, _ in inventory}
    assert {address for address, _ in listening} <= {"127.0.0.1"}  # one host: loopback only
    canary = other_users_cluster.home / "ran"
    report = probe_as_stranger(sorted(listening), canary)
    assert not canary.exists()
    # the scheduler and both ranks' workers answered, and refused a stranger's certificate;
    # their HTTP servers answered 404
    ports = [e for w, e in report.items() if w != "canary_exists"]
    assert sum(1 for e in ports if "certificate" in str(e["dask"]["tls"])) >= 3, report
    assert sum(1 for e in ports if e["http"].get("/") == "404") >= 3, report
    assert_nothing_got(report, other_users_cluster.info["marker"])
    assert other_users_cluster.ask("check", timeout=120)["ok"]  # the ranks and dask still work


@needs_users
def test_no_file_of_the_cluster_opens_for_a_stranger(other_users_cluster: Owned) -> None:
    roots = [tempfile.gettempdir(), "/dev/shm"]  # (the owner's home is in the first)
    assert str(other_users_cluster.home).startswith(tempfile.gettempdir())
    made = [
        os.path.join(top, name)
        for root in roots
        for top, dirs, files in os.walk(root)
        for name in files
        if (found := _lstat(os.path.join(top, name))) and found.st_uid == other_users_cluster.uid
    ]
    # the cluster wrote its certificates, logs, connection files and dask's scratch by now
    assert any(path.endswith("client-key.pem") for path in made), made
    assert any(path.endswith(".log") for path in made), made
    script = (
        "import json, sys\n"
        "opened = []\n"
        "for path in json.load(sys.stdin):\n"
        "    try:\n"
        "        open(path, 'rb').close()\n"
        "        opened.append(path)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(json.dumps(opened))\n"
    )
    done = subprocess.run(
        as_user(STRANGER, [SYSTEM_PYTHON, "-c", script]),
        input=json.dumps(made),
        env=user_env("/nonexistent"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    opened = json.loads(done.stdout)
    assert opened == [], f"a stranger could open {opened}"
    # nothing of dask's shared scratch place
    assert not any("dask-scratch-space" in p and not _under_private(p) for p in made), made
    # no directory of the cluster's others can enter beyond the owner's home (dask's scratch,
    # torch's /tmp/torchinductor_<user>), whose own are made by the test
    shared = [
        top
        for root in roots
        for top, _, _ in os.walk(root)
        if not top.startswith(str(other_users_cluster.home))
        and HOME_PREFIX not in top  # (another run's test home, and what it holds)
        and (found := _lstat(top))
        and found.st_uid == other_users_cluster.uid
        and found.st_mode & 0o077
        and not _under_private(top)
    ]
    assert shared == [], shared


def test_the_docs_list_every_port_and_what_protects_it() -> None:
    page = (HERE.parent / "docs" / "multi-host.md").read_text()  # (once the README's section)
    section = page.split("## Security: no one else gets in", 1)[1].split("\n## ", 1)[0]
    assert describe_ports() in section
    for heading in ("Threat model", "Not protected", "gloo and NCCL traffic", "private"):
        assert heading in section


def _lstat(path: str) -> os.stat_result | None:
    """``os.lstat(path)``, or None once it is gone (other tests' temporary files come and go
    while the walk runs: pytest deletes old ``garbage-*`` directories at any time)."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _under_private(path: str) -> bool:
    """Whether some directory above ``path`` is owner-only."""
    parent = Path(path).parent
    while parent != parent.parent:
        try:
            if os.stat(parent).st_mode & 0o077 == 0:
                return True
        except FileNotFoundError:
            return True  # (gone: no one opens it)
        parent = parent.parent
    return False


def test_a_missing_certificate_fails_dask_naming_it_and_leaves_no_dask(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    client = pooled_cluster_2.dask()
    scheduler_port = int(client.scheduler.address.rsplit(":", 1)[1])
    tls = Path(pooled_cluster_2._watch.path) / "tls"
    assert sorted(os.listdir(tls)) == [
        "ca.pem", "client-key.pem", "client.pem", "scheduler-key.pem", "scheduler.pem",
        "worker-key.pem", "worker.pem",
    ]  # fmt: skip
    assert {oct(os.stat(tls / f).st_mode & 0o777) for f in os.listdir(tls)} == {"0o600"}
    client.close()  # the next call makes a new client, reading the files again
    os.remove(tls / "worker-key.pem")
    with pytest.raises(CertificateError, match=r"worker-key\.pem is missing .* restart"):
        pooled_cluster_2.dask()
    assert pooled_cluster_2.run(_has_dask_worker, stream=False) == [False, False]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", scheduler_port), timeout=2).close()
    # a file that cannot be read (as root, modes do not stop a read: a directory instead)
    os.mkdir(tls / "worker-key.pem")
    with pytest.raises(CertificateError, match=r"worker-key\.pem is missing or unreadable"):
        pooled_cluster_2.dask()
    pooled_cluster_2.restart()  # new certificates, as the error says
    assert pooled_cluster_2.dask().submit(sum, [1, 2]).result(timeout=30) == 3


def _has_dask_worker() -> bool:
    from IPython import get_ipython

    return "dask_worker" in get_ipython().user_ns


@needs_users
def test_the_probe_finds_what_unprotected_ports_give(tmp_path: Path) -> None:
    """The probe can fail: against ports nothing protects it reads the published marker, gets
    a page, and runs code through a dask scheduler (so the refusals above are the cluster's
    doing, not the probe's)."""
    import http.server

    import distributed
    import zmq

    marker = "open-marker-1b2c"
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def publish() -> None:
        while not stop.wait(0.05):
            pub.send(marker.encode())

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(marker.encode())

        def log_message(self, *args: object) -> None:
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    threading.Thread(target=publish, daemon=True).start()
    canary = tmp_path / "ran"  # (the scheduler runs as root here: it can write there)
    with distributed.LocalCluster(
        n_workers=0,
        processes=False,
        protocol="tcp",
        host="127.0.0.1",
        dashboard_address="127.0.0.1:0",
    ) as open_dask:
        dask_port = int(open_dask.scheduler_address.rsplit(":", 1)[1])
        ports = [("127.0.0.1", pub_port), ("127.0.0.1", web.server_port), ("127.0.0.1", dask_port)]
        report = probe_as_stranger(ports, canary)
    stop.set()
    web.shutdown()
    context.destroy(linger=0)
    assert canary.exists(), report  # code ran (as root: the stranger cannot see in there)
    published = report[f"127.0.0.1:{pub_port}"]["zmq"]
    assert published["bytes"] > 0 and marker.encode().hex() in published["sub"]
    assert report[f"127.0.0.1:{web.server_port}"]["http"]["/"].startswith("200")
    assert report[f"127.0.0.1:{dask_port}"]["dask"]["tcp"] == "CONNECTED and ran code"
    with pytest.raises(AssertionError):
        assert_nothing_got(report, marker)
