"""One path to the ranks (issue 47): every message for the engines leaves the kernel through
``cluster/sending.py``'s ``dispatch`` (features through ``Transport.send``/``run``, the
control channel through ``Transport.control_call``), and a call for many ranks is one
broadcast message whose replies stay each rank's own."""

from __future__ import annotations

import ast
import pathlib

import pytest

import axon_nb
from axon_nb.rank import entry

PACKAGE = pathlib.Path(axon_nb.__file__).parent
SENDING = {"apply_async", "apply_sync", "broadcast_view"}
"""ipyparallel's ways to send (a view's, or the client's view of broadcasts); and a view's
``execute``, told from ``Transport.execute`` by its ``block=``/``silent=``."""


def _sends(path: pathlib.Path) -> list[str]:
    """``.apply_async(`` and the like called on anything in ``path``."""
    tree = ast.parse(path.read_text())
    return [
        f"{path.relative_to(PACKAGE)}:{node.lineno} .{node.func.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and (
            node.func.attr in SENDING
            or (
                node.func.attr == "execute" and {"block", "silent"} & {k.arg for k in node.keywords}
            )
        )
    ]


def test_only_sending_dispatch_hands_ipyparallel_a_message() -> None:
    found = [s for p in PACKAGE.rglob("*.py") if p.name != "sending.py" for s in _sends(p)]
    assert found == []
    assert _sends(PACKAGE / "cluster" / "sending.py")  # (the check does see calls)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_call_for_every_rank_is_one_broadcast_with_a_reply_per_rank(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    sent = pooled_cluster_2.send(entry.rank_status)
    assert len({m.rsplit("_", 1)[0] for m in sent.ar.msg_ids}) == 1  # one message went
    assert len(sent.ar.msg_ids) == 2  # each rank answers under its own id
    assert [s["rank"] for s in sent.wait(stream=False)] == [0, 1]
    client = pooled_cluster_2.client
    assert not client.outstanding  # nothing left counted as running
    assert not any(m in client._futures for m in sent.ar.msg_ids)  # nor kept
