"""Clusters that span machines: two hosts in network namespaces, each with its own host name,
address and a real sshd; MPICH's hydra starts the ranks on them over ssh."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
from equivalence import check_equal
from models import make_data, make_mlp, mse
from netns_hosts import IFACE, NetnsHosts, missing

import axon_nb
from axon_nb import FSDP
from axon_nb.errors import RankDiedError

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.usefixtures("no_pooled_clusters"),
    pytest.mark.timeout(400),
    pytest.mark.skipif(missing() is not None, reason=f"namespaced hosts: {missing()}"),
]


@pytest.fixture(scope="module")
def hosts() -> Iterator[NetnsHosts]:
    with NetnsHosts(2) as made:
        os.environ["HYDRA_LAUNCHER_EXEC"] = made.ssh  # how a user names their own ssh
        try:
            yield made
        finally:
            del os.environ["HYDRA_LAUNCHER_EXEC"]


def _listening(pids: list[int]) -> list[tuple[str, str, int]]:
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
            if c.status == psutil.CONN_LISTEN or c.type == socket.SOCK_DGRAM:
                found.append((command, c.laddr.ip, c.laddr.port))
    return found


def test_ranks_on_two_hosts_train_listen_on_their_network_and_leave_nothing(
    hosts: NetnsHosts,
) -> None:
    spec = ",".join(f"{address}:2" for address in hosts.addresses)
    cluster = axon_nb.Cluster(n=4, hosts=spec, iface=IFACE, timeout=60, start_timeout=120)
    with cluster:
        assert [(r["host"], r["local_rank"]) for r in cluster.ranks] == [
            ("axnb1", 0), ("axnb1", 1), ("axnb2", 0), ("axnb2", 1),
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
        remote = [p for name in hosts.names for p in hosts.pids(name) if not _is_sshd(p)]
        allowed = {"127.0.0.1", "::1", *hosts.addresses}
        exposed = [entry for entry in _listening(remote) if entry[1] not in allowed]
        assert exposed == [], exposed
        here = _listening([p.pid for p in kernel_side])
        controller = {e[1] for e in here if "controller" in e[0]}
        assert controller == {"10.77.0.1", "127.0.0.1"}  # the ranks' network, not all
        # the one exception, which MPICH cannot narrow: hydra's control port for its proxies
        wide = [e for e in here if e[1] not in {"10.77.0.1", "127.0.0.1", "::1"}]
        assert [e[0].split()[0].rsplit("/", 1)[-1] for e in wide] == ["mpiexec"], wide
        assert "mpiexec" in cluster.exposure() and "10.77.0.1" in cluster.exposure()

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
    assert _left_after(hosts, seconds=20) == [[], []]  # nothing left anywhere


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
cluster.apply([0], busy.sleep_in_cell)
cluster.apply([1], busy.hold_the_gil_in_c)
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
        assert all(_ours(hosts, name) for name in hosts.names)  # a rank on each host
        started = time.monotonic()
        if ending == "sigkill":
            proc.send_signal(signal.SIGKILL)  # no atexit: the reaper stops the cluster
            proc.wait(timeout=30)
        else:
            assert float(proc.stdout.readline().split()[1]) < limit
        assert _left_after(hosts, seconds=limit + 10) == [[], []]
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
