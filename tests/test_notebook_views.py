"""Notebook data that is a view: columns, slices, transposes, strided and expanded tensors,
NumPy arrays and a pandas DataFrame in one dataset. Each storage goes to the host once as the
span its views use (a column of a wide matrix as its own copy), the ranks rebuild the same
views sharing where the notebook's share, and training equals ``train_local``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from models import mse
from torch import nn

import axon_nb
from axon_nb.rank import entry
from axon_nb.train import notebook_data

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

ROWS, WIDTH, OUT = 4096, 128, 64


class Views(torch.utils.data.Dataset):
    """A dataset of the notebook's whose arrays view one another."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        base = torch.randn(ROWS, WIDTH + OUT, generator=g)
        self.x = base[:, :WIDTH]  # a slice of columns: 2/3 of its span, sent as the span
        self.x_t = base.T  # the transpose: the same storage, sharing with x on the ranks
        self.y = base[:, WIDTH:]  # 1/3 of its span: sent as its own contiguous copy
        self.label = base[:, -1]  # 16 KiB: in the skeleton, without the 3 MiB it views
        self.scale = torch.linspace(0.5, 1.5, WIDTH).expand(ROWS, WIDTH)  # stride 0
        wide = np.random.default_rng(0).standard_normal((2 * ROWS, OUT)).astype(np.float32)
        self.every_other = wide[::2]  # a strided NumPy view
        self.frame = pd.DataFrame(np.random.default_rng(1).random((ROWS, OUT), np.float32))

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.from_numpy(self.every_other[i, :1].copy())
        frame = torch.from_numpy(self.frame.iloc[i].to_numpy(np.float32, copy=True))
        features = self.x[i] * self.scale[i] + self.x_t[:, i][:WIDTH] * 0.5 + noise
        return features, self.y[i] + 0.1 * frame


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, OUT))


ARGS: dict[str, Any] = dict(model=model, loss=mse, steps=6, batch_size=64, seed=3)


def rebuilt_sharing(shared: Any) -> dict[str, Any]:
    """On a rank: rebuild the dataset, say what shares memory and what equals the notebook's."""
    from axon_nb.rank.data.shared_tensors import rebuild

    ds = rebuild(shared)
    return {
        "x_and_x_t_share": ds.x.untyped_storage().data_ptr() == ds.x_t.untyped_storage().data_ptr(),
        "x_t_is_x_transposed": bool(torch.equal(ds.x_t[:WIDTH].T, ds.x)),
        "strides": (ds.x.stride(), ds.x_t.stride(), ds.scale.stride()),
        "numpy": type(ds.every_other).__name__,
        "frame": float(ds.frame.to_numpy().sum()),
        "label": bool(torch.equal(ds.label, ds.x_t[-1])),
    }


def held_bytes() -> int:
    from axon_nb.rank.data import shared_tensors

    return sum(shared_tensors.held_bytes().values())


def test_views_go_once_as_their_spans_and_train_as_in_one_process(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    ds = Views()
    notebook_data.forget(pooled_cluster_2)
    before_held = pooled_cluster_2.run(held_bytes, stream=False)
    base = dataclasses.replace(notebook_data.stats(pooled_cluster_2))
    result = pooled_cluster_2.train(**ARGS, data=ds)
    assert result.losses == pytest.approx(axon_nb.train_local(**ARGS, data=ds).losses, rel=1e-5)

    sent = notebook_data.stats(pooled_cluster_2)
    base_span = ROWS * (WIDTH + OUT) * 4  # x and x_t: one span, the whole base
    y_copy = ROWS * OUT * 4
    numpy_span = (2 * ROWS - 1) * OUT * 4  # every other row: first to last
    frame = ROWS * OUT * 4
    scale = WIDTH * 4  # 2 MiB as the notebook sees it: one row, expanded
    spans = base_span + y_copy + numpy_span + frame + scale
    assert sent.bytes_sent - base.bytes_sent == spans
    assert sent.tensors_sent - base.tensors_sent == 5
    after = pooled_cluster_2.run(held_bytes, stream=False)
    held = [a - b for a, b in zip(after, before_held, strict=True)]
    assert held[0] == held[1] == spans  # one mapped copy per host; both ranks map it

    shared = notebook_data.share(pooled_cluster_2, ds)
    assert len(shared.skeleton) < 64 << 10
    assert (
        notebook_data.stats(pooled_cluster_2).bytes_sent == sent.bytes_sent
    )  # unchanged: nothing sent
    on_rank = pooled_cluster_2.run(rebuilt_sharing, shared, stream=False)[0]
    assert on_rank["x_and_x_t_share"] and on_rank["x_t_is_x_transposed"]
    assert on_rank["strides"] == (ds.x.stride(), ds.x_t.stride(), ds.scale.stride())
    assert on_rank["numpy"] == "ndarray" and on_rank["label"]
    assert on_rank["frame"] == pytest.approx(float(ds.frame.to_numpy().sum()), rel=1e-6)
    pooled_cluster_2.run(entry.shared_held, [], [m.key for m in shared.tensors], stream=False)
