"""Ranks as a Slurm job: a real slurmctld and slurmd (one node, this host) run the engines'
batch job, in which MPICH's hydra starts the ranks with srun."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psutil
import pytest
from equivalence import check_equal
from models import make_data, make_mlp, mse
from slurm_local import LocalSlurm, missing

import axon_nb
from axon_nb import DDP

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(300),
    pytest.mark.skipif(missing() is not None, reason=f"a private Slurm: {missing()}"),
]


@pytest.fixture(scope="module")
def slurm() -> Iterator[LocalSlurm]:
    with LocalSlurm() as started:
        yield started


def test_ranks_run_as_a_slurm_job_and_stopping_cancels_it(slurm: LocalSlurm) -> None:
    with pytest.raises(ValueError, match="Slurm job options: add --engines slurm"):
        axon_nb.Cluster(n=2, partition="debug")
    cluster = axon_nb.Cluster(
        n=2, engines="slurm", partition="debug", time="10:00", timeout=60, start_timeout=120
    )
    with cluster:
        assert len(slurm.jobs()) == 1  # the engines' job
        assert [r["local_rank"] for r in cluster.ranks] == [0, 1]
        args = dict(model=make_mlp, data=make_data, loss=mse, steps=3, batch_size=16)
        ref = axon_nb.train_local(**args)
        check_equal(cluster, ref, {**args, "strategy": DDP()}, loss_tol=1e-5, param_tol=1e-5)
        pids = [r["pid"] for r in cluster.ranks]
    deadline = time.monotonic() + 20  # (a job being cancelled is listed until it completes)
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurm.jobs() == []  # stopping the cluster ended the job
    assert not [p for p in pids if psutil.pid_exists(p)]
