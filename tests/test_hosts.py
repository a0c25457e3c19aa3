"""Clusters that span machines: two hosts in network namespaces, each with its own host name,
address and a real sshd; MPICH's hydra starts the ranks on them over ssh. A third host on the
same network runs no rank: a stranger's machine."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import psutil
import pytest
from equivalence import check_equal
from models import make_data, make_mlp, mse
from netns_hosts import IFACE, NetnsHosts, missing
from other_users import assert_nothing_got, print_marker, probe_as_stranger
from other_users import missing as users_missing
from resize_runs import resize_during_run

import axon_nb
from axon_nb import DDP, FSDP
from axon_nb.cluster.dask_on_ranks import workers_by_rank
from axon_nb.errors import RankDiedError

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.usefixtures("no_pooled_clusters"),
    pytest.mark.timeout(400),
    pytest.mark.skipif(missing() is not None, reason=f"namespaced hosts: {missing()}"),
]


@pytest.fixture(scope="module")
def hosts() -> Iterator[NetnsHosts]:
    with NetnsHosts(3) as made:  # the third: a stranger's
        os.environ["HYDRA_LAUNCHER_EXEC"] = made.ssh  # how a user names their own ssh
        try:
            yield made
        finally:
            del os.environ["HYDRA_LAUNCHER_EXEC"]


def _listening(pids: list[int], tcp_only: bool = False) -> list[tuple[str, str, int]]:
    """(command, address, port) of every listening TCP and bound UDP socket of ``pids``
    (``net_connections`` reads the socket table of each process's own namespace)."""
    found = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            command = " ".join(proc.cmdline()[:4])
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in conns:
            udp = c.type == socket.SOCK_DGRAM and not tcp_only
            if c.status == psutil.CONN_LISTEN or udp:
                found.append((command, c.laddr.ip, c.laddr.port))
    return found


def test_ranks_on_two_hosts_train_listen_on_their_network_and_leave_nothing(
    hosts: NetnsHosts,
) -> None:
    spec = ",".join(f"{address}:2" for address in hosts.addresses[:2])
    cluster = axon_nb.Cluster(n=4, hosts=spec, iface=IFACE, timeout=60, start_timeout=120)
    with cluster:
        assert [(r["host"], r["local_rank"]) for r in cluster.ranks] == [
            (hosts.names[0], 0), (hosts.names[0], 1), (hosts.names[1], 0), (hosts.names[1], 1),
        ]  # fmt: skip
        assert cluster.ranks_per_host == 2
        store = f"tcp://{hosts.addresses[0]}:{cluster.ranks[0]['master_port']}"
        assert {r["store"] for r in cluster.ranks} == {store}  # rank 0's address on axeth0
        assert "axeth0" in cluster.run(lambda: os.environ["GLOO_SOCKET_IFNAME"], ranks=[3])[0]
        # one host's ranks shard, the two hosts replicate: equal to one process
        args = dict(model=make_mlp, data=make_data, loss=mse, steps=4, batch_size=16)
        ref = axon_nb.train_local(**args)
        check_equal(
            cluster, ref, {**args, "strategy": FSDP(sharding="hybrid_shard")},
            loss_tol=1e-5, param_tol=1e-5,
        )  # fmt: skip
        groups = cluster.run(_shard_group, stream=False)
        assert groups == [[0, 1], [0, 1], [2, 3], [2, 3]]

        kernel_side = psutil.Process().children(recursive=True)
        remote = [p for name in hosts.names[:2] for p in hosts.pids(name) if not _is_sshd(p)]
        allowed = {"127.0.0.1", "::1", *hosts.addresses}
        assert remote
        exposed = [
            entry
            for name in hosts.names[:2]
            for entry in _netns_listening(name)
            if entry[0] not in allowed
        ]
        assert exposed == [], exposed
        here = _listening([p.pid for p in kernel_side])
        controller = {e[1] for e in here if "controller" in e[0]}
        assert controller == {hosts.gateway, "127.0.0.1"}  # the ranks' network, not all
        # the one exception, which MPICH cannot narrow: hydra's control port for its proxies
        wide = [e for e in here if e[1] not in {hosts.gateway, "127.0.0.1", "::1"}]
        assert [e[0].split()[0].rsplit("/", 1)[-1] for e in wide] == ["mpiexec"], wide
        assert "mpiexec" in cluster.exposure() and hosts.gateway in cluster.exposure()

        victim = cluster.ranks[3]["pid"]  # a rank on the other host
        killed = [0.0]

        def kill_soon() -> None:
            time.sleep(3)
            killed[0] = time.monotonic()
            os.kill(victim, signal.SIGKILL)

        import threading

        threading.Thread(target=kill_soon, daemon=True).start()
        with pytest.raises(RankDiedError, match="rank 3 died"):
            cluster.run(time.sleep, 60, stream=False)
        assert time.monotonic() - killed[0] < 15
    # each host's proxy ends its ranks once mpiexec's ssh connection to it closes: soon after
    assert _left_after(hosts, seconds=20) == [[], [], []]  # nothing left anywhere


def test_a_run_goes_on_through_resizes_across_two_hosts(hosts: NetnsHosts) -> None:
    """Grown onto a slot more on each host (``add_hosts``: a second hydra launch over ssh)
    and shrunk again, each during a run that then equals ``train_local``."""
    a, b = hosts.addresses[:2]
    cluster = axon_nb.Cluster(n=2, hosts=f"{a}:1,{b}:1", iface=IFACE, timeout=60,
                              start_timeout=120)  # fmt: skip
    with cluster:
        resize_during_run(cluster, DDP(), 4, add_hosts=f"{a}:1,{b}:1")
        first, second = hosts.names[:2]
        assert [(r["host"], r["local_rank"], r["local_world_size"]) for r in cluster.ranks] == [
            (first, 0, 2), (second, 0, 2), (first, 1, 2), (second, 1, 2),
        ]  # fmt: skip
        store = f"tcp://{a}:{cluster.ranks[0]['master_port']}"
        assert {r["store"] for r in cluster.ranks} == {store}
        assert cluster.options.hosts == ((a, 2), (b, 2))
        resize_during_run(cluster, FSDP(), 2)
        assert [r["host"] for r in cluster.ranks] == [first, second]
    assert _left_after(hosts, seconds=20) == [[], [], []]  # retired ranks' parents too


def _shard_group() -> list[int]:
    """The ranks this rank's FSDP parameters are sharded over."""
    import torch.distributed as dist

    from axon_nb.rank.training import trainstate

    param = next(trainstate.get("model").module.parameters())
    mesh = param.device_mesh
    group = mesh.get_group(mesh.ndim - 1)
    return dist.get_process_group_ranks(group)


def _is_sshd(pid: int) -> bool:
    try:
        return psutil.Process(pid).name() == "sshd"
    except psutil.Error:
        return True


STARTER = """
import sys, time
import axon_nb, busy
cluster = axon_nb.Cluster(n=2, hosts=sys.argv[1], timeout=60, start_timeout=120).start()
# Busy ranks: rank 0 sleeps in its cell, rank 1 holds the GIL in native code.
cluster.send(busy.sleep_in_cell, ranks=[0])
cluster.send(busy.hold_the_gil_in_c, ranks=[1])
time.sleep(1.5)
print("started", flush=True)
if sys.argv[2] == "stop":
    began = time.monotonic()
    cluster.stop()
    print(f"stopped {time.monotonic() - began:.1f}", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(("ending", "limit"), [("stop", 10.0), ("sigkill", 15.0)])
def test_busy_ranks_on_two_hosts_leave_no_process_on_any_host(
    hosts: NetnsHosts, tmp_path, ending: str, limit: float
) -> None:
    script = tmp_path / "starter.py"
    script.write_text(STARTER)
    spec = f"{hosts.addresses[0]}:1,{hosts.addresses[1]}:1"
    command = [sys.executable, str(script), spec, ending]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "started"
        assert all(_ours(hosts, name) for name in hosts.names[:2])  # a rank on each host
        started = time.monotonic()
        if ending == "sigkill":
            proc.send_signal(signal.SIGKILL)  # no atexit: the reaper stops the cluster
            proc.wait(timeout=30)
        else:
            assert float(proc.stdout.readline().split()[1]) < limit
        assert _left_after(hosts, seconds=limit + 10) == [[], [], []]
        assert time.monotonic() - started < limit
    finally:
        proc.kill()


def _ours(hosts: NetnsHosts, name: str) -> list[int]:
    return [p for p in hosts.pids(name) if not _is_sshd(p)]


def _left_after(hosts: NetnsHosts, seconds: float) -> list[list[str]]:
    """The command lines of our processes on each host once they are gone or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while any(_ours(hosts, n) for n in hosts.names) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [[c for c in map(_command, _ours(hosts, name)) if c] for name in hosts.names]


def _command(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline()[:4])
    except psutil.Error:
        return ""  # gone meanwhile


MARKER = "axon-two-host-marker-5c1e"


@pytest.mark.skipif(users_missing() is not None, reason=f"other users: {users_missing()}")
def test_a_third_host_gets_nothing_from_a_two_host_cluster(hosts: NetnsHosts, tmp_path) -> None:
    spec = f"{hosts.addresses[0]}:1,{hosts.addresses[1]}:1"
    cluster = axon_nb.Cluster(n=2, hosts=spec, iface=IFACE, timeout=60, start_timeout=120)
    with cluster:
        client = cluster.dask()
        assert client.scheduler.address.startswith(f"tls://{hosts.gateway}:")
        assert sorted(urlsplit(a).hostname for a in workers_by_rank(client).values()) == [
            *hosts.addresses[:2]
        ]  # each rank's worker on its host's address, over TLS
        processes = psutil.Process().children(recursive=True)
        processes += [
            psutil.Process(p) for n in hosts.names[:2] for p in hosts.pids(n) if not _is_sshd(p)
        ]
        here = _listening([p.pid for p in psutil.Process().children(recursive=True)], True)
        ports = sorted(
            {
                (hosts.gateway if address in ("0.0.0.0", "::") else address, port)
                for _, address, port in here
                if address not in ("127.0.0.1", "::1")
            }
            | {entry for name in hosts.names[:2] for entry in _netns_listening(name)}
        )
        assert (hosts.gateway, int(client.scheduler.address.rsplit(":", 1)[1])) in ports
        assert any(address == hosts.addresses[0] for address, _ in ports)  # the ranks' ports
        # the cluster's keys are in no process's command line, on any host
        secrets = _cluster_secrets(cluster)
        for proc in processes:
            with contextlib.suppress(psutil.Error):
                command = " ".join(proc.cmdline())
                assert not any(secret in command for secret in secrets), command
        cluster.run(print_marker, MARKER, 40, stream=False)
        canary = tmp_path / "ran"  # (the owner, root, could write it; the stranger cannot)
        report = probe_as_stranger(ports, canary, netns=hosts.names[2])
        assert not canary.exists()
        # the scheduler and the workers on both hosts refused a stranger's certificate
        refused = [w for w, e in report.items() if "certificate" in str(e)]
        assert {w.split(":")[0] for w in refused} == {hosts.gateway, *hosts.addresses[:2]}
        assert_nothing_got(report, MARKER)
        assert cluster.run(lambda: 1, stream=False) == [1, 1]  # the probing harmed nothing
        assert client.submit(sum, [1, 2]).result(timeout=30) == 3


def _netns_listening(name: str) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in host ``name`` beyond loopback, but
    its sshd's (``ss`` in its namespace: psutil reads this one's socket table)."""
    out = subprocess.run(
        ["ip", "netns", "exec", name, "ss", "-Htln"], capture_output=True, text=True, timeout=10
    ).stdout
    found = set()
    for line in out.splitlines():
        address, _, port = line.split()[3].rpartition(":")
        if address not in ("127.0.0.1", "[::1]") and port != "22":
            found.add((address, int(port)))
    return found


def _cluster_secrets(cluster: axon_nb.Cluster) -> list[str]:
    """The HMAC key, the controller's CurveZMQ key and the dask keys of ``cluster``."""
    import json
    from pathlib import Path

    profile = Path(cluster._ipp.profile_dir) / "security"
    info = json.loads((profile / f"ipcontroller-{cluster._ipp.cluster_id}-client.json").read_text())
    assert info["key"] and info["curve_serverkey"]  # HMAC and CurveZMQ both on
    tls = Path(cluster._watch.path) / "tls"
    keys = [
        line
        for name in ("client-key.pem", "worker-key.pem", "scheduler-key.pem")
        for line in (tls / name).read_text().splitlines()
        if "-----" not in line
    ]
    return [info["key"], info["curve_serverkey"], *keys]
