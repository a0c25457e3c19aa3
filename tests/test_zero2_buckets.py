"""ZeRO-2's buckets on their own (one process, a one-rank gloo group in a subprocess): a small
model is split into several, and gradients that come twice before their bucket is reduced
(two backwards, a bucket waiting for a parameter the first one did not use) are summed."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest
from torch import nn

from axon_nb.parallel.zero2 import MIN_BUCKETS, bucket_cap

SCRIPT = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    from torch import nn
    from axon_nb.parallel.zero2 import GradShardedModel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    layers = {f"filler{i}": nn.Linear(4, 4) for i in range(6)}
    net = nn.ModuleDict({**layers, "unused": nn.Linear(4, 4), "used": nn.Linear(4, 4)})
    model = GradShardedModel(net, None)  # 8 layers: buckets of a quarter, 4 tensors each
    bucket = next(b for b in model.buckets if any(p is net["used"].weight for p in b.params))
    assert any(p is net["unused"].weight for p in bucket.params)  # the same bucket
    x = torch.ones(2, 4)
    for _ in range(2):  # two backwards before the reduce: the bucket waits for 'unused'
        net["used"](x).sum().backward()
    model.finish_backward()
    for p, offset in zip(bucket.params, bucket.offsets):
        got = bucket.shard.grad[offset : offset + p.numel()]
        want = 0.0 if any(p is q for q in net["unused"].parameters()) else 4.0  # 2 x 2 samples
        assert torch.all(got == want), (p.shape, got)
    print("ok")
    """
)


def test_a_small_model_is_split_into_buckets() -> None:
    params = [p for p in nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]).parameters()]
    total = sum(p.numel() * 4 for p in params)
    assert bucket_cap([params], 25.0) == total // MIN_BUCKETS  # 25 MiB would be one bucket
    assert bucket_cap([params], 0.01) == int(0.01 * 2**20)  # a smaller cap stays


@pytest.mark.timeout(120)
def test_gradients_that_come_twice_before_the_reduce_are_summed() -> None:
    with socket.socket() as s:  # a free loopback port for the one-rank group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PORT": str(port), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=100, env=env
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
