"""Data loading: loader workers on a decode-heavy dataset, and dask data against in-memory data.

1. A map-style dataset whose items must be decoded (zlib-compressed rows, then a small FFT)
   trained on 2 ranks with ``loader=dict(num_workers=2)`` and with none, alternating: the
   ratio of samples/s (workers / none).
2. The same table trained from a dask DataFrame (``data=df, columns=...``, computed on the
   ranks' dask workers) and as an in-memory TensorDataset built by each rank, alternating:
   samples/s of the steps, and last the ratio dask / in-memory (target >= 0.9).

    python benchmarks/data_loading.py [--steps 60] [--warmup 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import zlib
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import axon_nb

ROWS, WIDTH, BATCH = 8192, 64, 64


def table() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(ROWS, WIDTH + 1)).astype(np.float32)


class Compressed(Dataset):
    """Rows stored compressed; each item is decompressed and filtered (an FFT) when read."""

    def __init__(self) -> None:
        self.rows = [zlib.compress(row.tobytes(), 9) for row in table()]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = np.frombuffer(zlib.decompress(self.rows[i]), dtype=np.float32)
        for _ in range(40):  # stand-in for image or audio decoding
            row = np.fft.irfft(np.fft.rfft(row), n=row.size).astype(np.float32)
        return torch.from_numpy(row[:WIDTH].copy()), torch.from_numpy(row[WIDTH:].copy())


def in_memory() -> TensorDataset:
    t = torch.from_numpy(table())
    return TensorDataset(t[:, :WIDTH], t[:, WIDTH:])


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 256), nn.GELU(), nn.Linear(256, 1))


def samples_per_s(cluster: Any, steps: int, warmup: int, **args: Any) -> float:
    result = cluster.train(
        model=model, loss=nn.functional.mse_loss, steps=steps, batch_size=BATCH, **args
    )
    measured = result.history[warmup:]
    return sum(h["samples"] for h in measured) / sum(h["step_time_s"] for h in measured)


def compare(
    cluster: Any, repeats: int, label: str, a: dict, b: dict, steps: int, warmup: int
) -> float:
    first, second = [], []
    for i in range(repeats):
        first.append(samples_per_s(cluster, steps, warmup, **a))
        second.append(samples_per_s(cluster, steps, warmup, **b))
        print(f"  run {i + 1}: {first[-1]:,.0f} vs {second[-1]:,.0f} samples/s", flush=True)
    ratio = statistics.median(first) / statistics.median(second)
    print(f"{label} = {ratio:.3f}")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import dask.dataframe as dd
    import pandas as pd

    columns = [f"f{i}" for i in range(WIDTH)]
    frame = pd.DataFrame(table(), columns=[*columns, "y"])
    df = dd.from_pandas(frame, npartitions=8, sort=False)
    with axon_nb.Cluster(n=2) as cluster:
        print("decode-heavy dataset, 2 loader workers against none:")
        compare(
            cluster, args.repeats, "workers/none",
            dict(data=Compressed, loader=dict(num_workers=2, persistent_workers=True)),
            dict(data=Compressed), args.steps, args.warmup,
        )  # fmt: skip
        print("dask DataFrame against an in-memory TensorDataset:")
        compare(
            cluster, args.repeats, "dask/in-memory",
            dict(data=df, columns=(columns, ["y"])), dict(data=in_memory),
            args.steps, args.warmup,
        )  # fmt: skip


if __name__ == "__main__":
    main()
