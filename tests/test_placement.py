"""Planning the world from rank probes: devices, backend, rendezvous (pure, no cluster)."""

from __future__ import annotations

import pytest

from axon_nb.spec.placement import PlacementError, Probe, plan_world


def probes(num_gpus: int, n: int = 2, hosts: tuple[str, ...] = ("a",)) -> list[Probe]:
    per_host = n // len(hosts)
    return [
        Probe(
            rank=r,
            host=hosts[r // per_host],
            ip=f"10.0.0.{r // per_host + 1}",
            iface="eth1",
            pid=100 + r,
            num_gpus=num_gpus,
            local_rank=r % per_host,
            local_world_size=per_host,
            free_port=5000 + r,
        )
        for r in range(n)
    ]


def test_cpu_only_auto_is_gloo_on_loopback() -> None:
    plans = plan_world(probes(num_gpus=0))
    assert [p.device for p in plans] == ["cpu", "cpu"]
    assert {p.backend for p in plans} == {"gloo"}
    assert {(p.master_addr, p.master_port) for p in plans} == {("127.0.0.1", 5000)}


def test_one_gpu_per_rank_auto_is_nccl_with_local_rank_binding() -> None:
    plans = plan_world(probes(num_gpus=2, n=4, hosts=("a", "b")))
    assert [p.device for p in plans] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert {p.backend for p in plans} == {"nccl"}
    assert {p.master_addr for p in plans} == {"10.0.0.1"}  # rank 0's host, not loopback


def test_gpus_option_picks_devices_and_leftover_ranks_use_cpu() -> None:
    plans = plan_world(probes(num_gpus=4, n=2), gpus=(3,))
    assert [p.device for p in plans] == ["cuda:3", "cpu"]
    assert plans[0].backend == "gloo"


def test_gpus_naming_a_missing_device_is_refused() -> None:
    with pytest.raises(PlacementError, match=r"cuda:5, which does not exist on host a"):
        plan_world(probes(num_gpus=2), gpus=(0, 5))


def test_nccl_without_a_gpu_per_rank_is_refused() -> None:
    with pytest.raises(PlacementError, match=r"nccl needs one GPU per rank.*rank\(s\) 1"):
        plan_world(probes(num_gpus=1), backend="nccl")


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(PlacementError, match="unknown backend 'mpi'"):
        plan_world(probes(num_gpus=0), backend="mpi")
