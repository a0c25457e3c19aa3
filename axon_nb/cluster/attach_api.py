"""``axon_nb.attach``: a kernel takes up a detached cluster (``%axon_attach NAME``).

Example::

    cluster = axon_nb.attach("lab")     # prints what the ranks said while no one watched
    cluster.handle("model").show()      # the run's dashboard: the whole run, streaming on
"""

from __future__ import annotations

from pathlib import Path

from axon_nb.cluster.cluster import Cluster
from axon_nb.spec.kept_runs import output_path

REPLAY_BYTES = 64 * 1024
"""How much of each rank's kept output ``attach`` prints (the rest stays in its file)."""


def attach(name: str, *, replay: bool = True) -> Cluster:
    """The running detached cluster ``name`` of this user, from any kernel: the same ranks,
    their names (set by earlier ``%%axon`` cells) and models, and its runs
    (``cluster.handle(name)``). With ``replay``, each rank's latest output is printed first.

    Example::

        cluster = axon_nb.attach("lab")
        result = cluster.handle("model").wait()
    """
    cluster = Cluster.attach(name)
    if replay and cluster.detached is not None:
        for rank in range(len(cluster.ranks)):
            print_kept_output(output_path(cluster.detached.root, rank), rank)
    return cluster


def print_kept_output(path: Path, rank: int) -> None:
    """The last ``REPLAY_BYTES`` of rank ``rank``'s kept output, each line labelled."""
    try:
        data = path.read_bytes()
    except OSError:
        return
    if not data:
        return
    cut = len(data) > REPLAY_BYTES or path.with_name(path.name + ".1").exists()
    text = data[-REPLAY_BYTES:].decode("utf-8", "replace")
    if len(data) > REPLAY_BYTES:
        text = text.split("\n", 1)[-1]  # (from a whole line)
    if cut:
        print(f"[rank {rank}] ... (earlier output in {path})")
    for line in text.rstrip("\n").split("\n"):
        print(f"[rank {rank}] {line}")
