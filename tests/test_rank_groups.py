"""Runs on live ranks reuse their process groups: a notebook that trains again and again (the
same layouts, periodic checkpoints) does not pile up gloo groups, each of which keeps three
threads and its sockets for the life of the world."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

import axon_nb
from axon_nb import DDP, FSDP
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
RUN = dict(
    model=functools.partial(GPT, CONFIG),
    data=functools.partial(token_dataset, 64, block_size=16, vocab_size=64),
    loss=lm_loss,
    batch_size=8,
    steps=2,
)


def _gloo_threads() -> int:
    """Threads of this rank's process that gloo started (its run loops)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sum(name.startswith("gloo") or name.startswith("pt_gloo") for name in names)


def test_training_again_and_again_keeps_the_same_groups(
    cluster: axon_nb.Cluster, tmp_path: Path
) -> None:
    calls = [DDP(), FSDP(), DDP(), FSDP(), DDP(), FSDP()]
    for i, strategy in enumerate(calls):
        cluster.train(
            **RUN, strategy=strategy, checkpoint_dir=tmp_path / str(i), checkpoint_every=1
        )
        if i == 1:  # each layout's groups, and the checkpoints', made once
            before = cluster.run(_gloo_threads, stream=False)
    assert cluster.run(_gloo_threads, stream=False) == before
