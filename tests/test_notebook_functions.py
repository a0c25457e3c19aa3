"""Functions defined in a notebook (module ``__main__``, using the notebook's ``torch`` and
``nn``) work in every feature that sends user code to the ranks: run, train, profile,
advise, compare, bandwidth and dask. Run in a real kernel by nbclient."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from axon_nb.notebooks import execute

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CELLS = [
    """
import torch
from torch import nn
import axon_nb
from axon_nb import DDP, FSDP

def make_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))

def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)

def rank_times(k):
    return torch.distributed.get_rank() * k

cluster = axon_nb.Cluster(n=2, timeout=60).start()
""",
    "print('run', cluster.run(rank_times, 10))",
    """
result = cluster.train(make_model, make_data(), loss=loss_fn, steps=3, batch_size=16)
print('train', len(result.losses))
""",
    """
profile = cluster.profile(make_model, make_data(), loss_fn)
print('profile', len(profile.layers))
""",
    """
advice = cluster.advise(make_model, make_data(), loss_fn, device_memory="1GB", batch_size=16)
print('advise', advice.best is not None)
""",
    """
table = cluster.compare([DDP(), FSDP()], model=make_model, data=make_data(), loss=loss_fn,
                        batch_size=16, steps=3, warmup=1)
print('compare', [(r['status'], r['predicted_peak_bytes'] is not None) for r in table.rows])
print(table)
""",
    "print('bandwidth', len(cluster.bandwidth('all_reduce', sizes='1K:2K', iters=2).rows))",
    """
client = cluster.dask()
print('dask', client.submit(rank_times, 0).result(), client.submit(make_model).result() is not None)
""",
    "cluster.stop()",
]


def test_notebook_defined_functions_work_in_every_feature(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.strip()) for c in CELLS])
    nbformat.write(nb, tmp_path / "functions.ipynb")
    done = execute(tmp_path / "functions.ipynb", tmp_path / "out.ipynb")
    text = "".join(o.get("text", "") for cell in done.cells for o in cell.get("outputs", []))
    assert "run [0, 10]" in text
    assert "train 3" in text
    assert "profile " in text and "NameError" not in text
    assert "advise True" in text
    assert "compare [('ok', True), ('ok', True)]" in text
    assert "bandwidth 2" in text
    assert "dask 0 True" in text
