"""Nothing exposed that need not be: every socket any process of a one-host cluster listens on
(controller, mpiexec, the ranks' parents, engines, nannies, the reaper) is on loopback, also
after training (gloo groups, mesh subgroups, a checkpoint group) and a re-formed world."""

from __future__ import annotations

import socket
from pathlib import Path

import psutil
import pytest
from helpers import engine_pids, nannies
from models import make_data, make_mlp, mse

import axon_nb
from axon_nb import FSDP

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.usefixtures("no_pooled_clusters"),
    pytest.mark.timeout(240),
]

LOOPBACK = {"127.0.0.1", "::1"}


def _cluster_processes() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def _listening() -> list[tuple[int, str, str, int]]:
    """(pid, command, address, port) of every listening TCP socket and bound UDP socket of
    this process's descendants."""
    found = []
    for proc in _cluster_processes():
        try:
            command = " ".join(proc.cmdline()[1:4])
            conns = proc.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        for conn in conns:
            udp = conn.type == socket.SOCK_DGRAM
            if conn.status == psutil.CONN_LISTEN or udp:
                found.append((proc.pid, command, conn.laddr.ip, conn.laddr.port))
    return found


def test_a_one_host_cluster_listens_on_loopback_only(tmp_path: Path) -> None:
    with axon_nb.Cluster(n=2, timeout=60) as cluster:
        assert "loopback only" in cluster.exposure()
        cluster.train(
            model=make_mlp, data=make_data, loss=mse, steps=4, batch_size=16, strategy=FSDP(),
            checkpoint_dir=tmp_path, checkpoint_every=2,
        )  # fmt: skip
        listening = _listening()
        assert any("controller_process" in cmd for _, cmd, _, _ in listening)
        # the engines (gloo, zmq) and their nannies: all seen
        engines = set(engine_pids(cluster))
        nanny_pids = {nanny.pid for nanny in nannies(cluster)}
        pids = {pid for pid, _, _, _ in listening}
        assert engines <= pids and nanny_pids <= pids and nanny_pids
        exposed = [entry for entry in listening if entry[2] not in LOOPBACK]
        assert exposed == [], exposed
        cluster._reform_world()  # a fresh world: a new store file, new gloo listeners
        assert cluster.run(lambda: __import__("torch").distributed.get_world_size()) == [2, 2]
        exposed = [entry for entry in _listening() if entry[2] not in LOOPBACK]
        assert exposed == [], exposed
        last = engine_pids(cluster)
    assert not [p for p in last if psutil.pid_exists(p)]
