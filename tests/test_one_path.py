"""One path to the ranks (issue 47): every message for the engines leaves the kernel through
``cluster/sending.py``'s ``dispatch`` (features through ``Transport.send``/``run``, the
control channel through ``Transport.control_call``), and a call for many ranks is one
message per host (the host relay) whose outcomes stay each rank's own and come back about
one message per host; the relay's sockets are the user's alone."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import time

import ipyparallel as ipp
import pytest
from helpers import until
from other_users import STRANGER, SYSTEM_PYTHON, as_user
from other_users import missing as users_missing

import axon_nb
from axon_nb.cluster import sending, startup
from axon_nb.cluster.relay import relay_of
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
def test_a_call_for_every_rank_is_one_message_with_an_outcome_per_rank(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    client = pooled_cluster_2.client
    sent_before = len(client.history)
    sent = pooled_cluster_2.send(entry.rank_status)
    assert len(client.history) - sent_before == 1  # one message went (one host)
    assert len({m.rsplit("_", 1)[0] for m in sent.ar.msg_ids}) == 1  # for one call
    assert len(sent.ar.msg_ids) == 2  # each rank answers under its own id
    assert [s["rank"] for s in sent.wait(stream=False)] == [0, 1]
    client = pooled_cluster_2.client
    assert not client.outstanding  # nothing left counted as running
    assert not any(m in client._futures for m in sent.ar.msg_ids)  # nor kept


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_the_kernel_reads_about_one_message_per_host_whatever_the_ranks(
    pooled_cluster_4: axon_nb.Cluster,
) -> None:
    """Four ranks on one host: their outcomes come gathered (ipyparallel's own way is three
    messages per rank: a reply, a busy and an idle status)."""
    relay = relay_of(pooled_cluster_4.client)
    assert relay is not None
    before = relay.outcome_messages
    for _ in range(10):
        assert pooled_cluster_4.run(os.getpid, stream=False) != []
    # (a rank's outcome waits for the others up to LINGER_S: under load a call may take two)
    assert relay.outcome_messages - before <= 20


def _relay_directory() -> tuple[str, int, int, list[str]]:
    from axon_nb.rank.world import relay

    directory = relay._state["directory"]
    status = os.stat(directory)
    return directory, status.st_mode & 0o777, status.st_uid, sorted(os.listdir(directory))


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_the_relay_sockets_are_in_owner_only_directories_no_other_user_can_enter(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    found = pooled_cluster_2.run(_relay_directory, stream=False)
    for directory, mode, owner, names in found:
        assert (mode, owner, names) == (0o700, os.getuid(), ["outcomes", "work"]), directory
    if users_missing() is not None:
        pytest.skip(users_missing())
    connect = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n    s.connect(sys.argv[1]); print('connected')\n"
        "except OSError as e:\n    print(type(e).__name__)\n"
    )
    for directory, *_ in found:
        argv = as_user(STRANGER, [SYSTEM_PYTHON, "-c", connect, f"{directory}/work"])
        done = subprocess.run(
            argv, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60
        )
        assert done.stdout.strip() == "PermissionError", done.stderr


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_relayed_cell_may_await_at_its_top_level(pooled_cluster_2: axon_nb.Cluster) -> None:
    """As ipykernel runs a cell with a top-level ``await`` (on the engine's event loop)."""
    code = "import asyncio\nawaited = await asyncio.sleep(0.01, result=rank + 100)\nawaited"
    parts = pooled_cluster_2.execute(code, stream=False)
    results = {rank: part.execute_result for rank, part in parts.items()}
    assert {r: v["data"]["text/plain"] for r, v in results.items()} == {0: "100", 1: "101"}


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_work_that_could_not_be_sent_leaves_nothing_counted_as_running(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    client = pooled_cluster_2.client
    relay = relay_of(client)
    assert relay is not None

    def refused(*_: object) -> None:
        raise ConnectionError("the controller is gone")

    with pytest.raises(ConnectionError):
        relay.send([0, 1], "code", b"x = 1", "execute", refused)
    assert not client.outstanding
    assert pooled_cluster_2.run(os.getpid, stream=False) != []  # and the next call goes


def _nap_on_rank_1(seconds: float) -> None:
    import time

    import torch.distributed as dist

    time.sleep(seconds if dist.get_rank() == 1 else 0)
    _seen().clear()


def _note(name: str) -> None:
    _seen().append(name)


def _seen() -> list[str]:
    import builtins

    return builtins.__dict__.setdefault("_axon_test_seen", [])  # type: ignore[no-any-return]


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_calls_to_a_rank_run_in_the_order_sent_whatever_their_hosts_leader(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """A call to rank 1 alone comes through rank 1's own engine, the next call to both ranks
    through rank 0: while rank 1 is busy, the second reached it first and ran first (every
    time, before the parts were numbered)."""
    for _ in range(2):
        pooled_cluster_2.send(_nap_on_rank_1, 1.0)
        time.sleep(0.3)  # (rank 1 is napping)
        first = pooled_cluster_2.send(_note, "A", ranks=[1])
        second = pooled_cluster_2.send(_note, "B")
        first.ar.get(timeout=30), second.ar.get(timeout=30)
        assert pooled_cluster_2.run(_seen, stream=False) == [["B"], ["A", "B"]]


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_leader_that_fails_to_pass_work_on_holds_up_no_later_call(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """Rank 1's part of a call whose leader failed never comes: the kernel tells rank 1 to
    skip its number, or rank 1 would hold every later part for ever."""
    client = pooled_cluster_2.client
    relay = relay_of(client)
    assert relay is not None

    def failing_leader(leaders: list[int], header: dict[str, object], payload: bytes,
                       plan: dict[int, object]) -> ipp.AsyncResult:  # fmt: skip
        if header["kind"] != "skip":  # (a plan without the leader: it raises KeyError)
            plan = {}
        return sending._forward(client, leaders, header, payload, plan)

    ar = relay.send([0, 1], "call", sending.packed_call(os.getpid, (), {}), "getpid",
                    failing_leader)  # fmt: skip
    with pytest.raises(ipp.error.RemoteError, match="KeyError"):
        ar.get(timeout=30)
    pooled_cluster_2.send(_note, "after", ranks=[1]).ar.get(timeout=30)  # (not held)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_per_rank_calls_merge_into_one_result_even_when_a_part_is_already_in(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """A resize sends each rank its own call and waits on them as one; CI once saw rank 0's
    part finish before the merge was made, and the client had already forgotten it (a relayed
    part is dropped from ipyparallel's books once in): ``KeyError: No Future or result``."""
    client = pooled_cluster_2.client
    first = sending.dispatch(client, [0], os.getpid)
    first.get(timeout=30)  # in, and forgotten by the client (a moment later, on its IO thread)
    assert until(lambda: first.msg_ids[0] not in client.results, seconds=10)
    second = sending.dispatch(client, [1], os.getpid)
    pids = startup.merged(client, [first, second], [0, 1]).get(timeout=30)
    assert pids == [p["pid"] for p in pooled_cluster_2.ranks]
