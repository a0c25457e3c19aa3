"""Validation of cluster options, before anything starts."""

from __future__ import annotations

import pytest

from axon_nb import Cluster
from axon_nb.cluster.options import parse_gpus


@pytest.mark.parametrize("n", [0, -2, 1.5, "4", True, None])
def test_number_of_ranks_must_be_a_positive_integer(n: object) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        Cluster(n)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"engines": "pbs"}, "unknown engines 'pbs': choose one of mpi, local, slurm"),
        ({"backend": "mpi"}, "unknown backend 'mpi'"),
        ({"gpus": (0, 0)}, "lists a device twice"),
        ({"gpus": (-1,)}, "device indices"),
        ({"gpus": (0,), "backend": "nccl"}, "lists 1 device"),
        ({"timeout": 0}, "timeout must be a positive, finite number"),
        ({"hosts": "node1:0"}, "bad host entry 'node1:0': write host or host:slots"),
        ({"hosts": "node1:1"}, "2 ranks do not fit the 1 slots of --hosts node1:1"),
        ({"hosts": "node1:2", "engines": "local"}, "use --engines mpi"),
        ({"iface": "eth1"}, "--iface chooses the network of a cluster across hosts"),
        ({"partition": "gpu"}, "Slurm job options: add --engines slurm"),
    ],
)
def test_bad_options_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Cluster(2, **kwargs)


def test_parse_gpus() -> None:
    assert parse_gpus("0,2") == (0, 2)
    assert parse_gpus(None) is None
    with pytest.raises(ValueError, match="comma-separated device indices"):
        parse_gpus("0;1")
