"""Dask on the ranks: ``cluster.dask()`` runs a worker in every rank, and ``train`` takes dask
DataFrames, Array pairs and Bags, each rank computing and keeping only its own share; the run
equals ``train_local`` on the same collection computed in one process."""

from __future__ import annotations

import http.client
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import dask
import dask.array as da
import dask.bag as db
import numpy as np
import pytest
import torch
from equivalence import check_equal
from models import mse

import axon_nb
from axon_nb import DDP, FSDP
from axon_nb.cluster.dask_on_ranks import workers_by_rank

if TYPE_CHECKING:
    import dask.dataframe as dd

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

FEATURES = ["f0", "f1", "f2", "f3", "f4", "f5", "f6", "f7"]


def frame(rows: int = 403, partitions: int = 4) -> dd.DataFrame:
    """A regression table with uneven partitions (the last rows do not fill a piece)."""
    import dask.dataframe as dd  # (here: 0.5 s that every pytest worker's collection skips)
    import pandas as pd

    rng = np.random.default_rng(7)
    x = rng.normal(size=(rows, 8)).astype(np.float32)
    w = rng.normal(size=(8, 4)).astype(np.float32)
    y = np.tanh(x @ w)
    table = pd.DataFrame(x, columns=FEATURES)
    for i in range(4):
        table[f"y{i}"] = y[:, i]
    return dd.from_pandas(table, npartitions=partitions, sort=False)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


ARGS: dict[str, Any] = dict(model=mlp, loss=mse, steps=12, batch_size=32)
TARGETS = ["y0", "y1", "y2", "y3"]


def _rows_held() -> int:
    from axon_nb.rank.training import trainstate

    return len(trainstate.get("model").dataset)


def test_the_ranks_are_the_dask_workers_on_loopback(pooled_cluster_2: axon_nb.Cluster) -> None:
    client = pooled_cluster_2.dask()
    info = client.sync(client.scheduler.identity, n_workers=-1)  # (the cache can be empty)
    assert sorted(w["name"] for w in info["workers"].values()) == ["rank-0", "rank-1"]
    pids = {w["name"]: w.get("pid") for w in info["workers"].values()}
    by_pid = client.run(lambda: __import__("os").getpid())
    assert sorted(by_pid.values()) == sorted(
        r["pid"] for r in pooled_cluster_2.ranks
    )  # in the engines
    hosts = {urlsplit(a).hostname for a in [client.scheduler.address, *info["workers"]]}
    assert hosts == {"127.0.0.1"}
    assert client.scheduler.address.startswith("tls://")  # (tests/test_security.py: refused)
    assert pooled_cluster_2.dask() is client  # made once
    assert "dask scheduler" in pooled_cluster_2.exposure()
    assert pids  # named per rank
    # dask work runs on the ranks
    assert dask.compute(da.ones(100, chunks=10).sum(), scheduler=client)[0] == 100


def test_a_dataframe_trains_as_in_one_process_each_rank_keeping_its_half(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    args = {**ARGS, "data": frame(), "columns": (FEATURES, TARGETS)}
    ref = axon_nb.train_local(**args)
    check_equal(pooled_cluster_2, ref, {**args, "strategy": DDP()}, loss_tol=1e-5, param_tol=1e-5)
    assert pooled_cluster_2.run(_rows_held, stream=False) == [200, 200]  # 4 pieces of 100, 2 each
    # a sharded strategy reads the same pieces
    check_equal(pooled_cluster_2, ref, {**args, "strategy": FSDP()}, loss_tol=1e-5, param_tol=1e-4)


def test_array_pairs_and_bags_train_as_in_one_process(pooled_cluster_2: axon_nb.Cluster) -> None:
    table = frame().compute()
    x = da.from_array(table[FEATURES].to_numpy(), chunks=(101, 4))
    y = da.from_array(table[TARGETS].to_numpy(), chunks=(60, 4))  # rechunked to x's rows
    ref = axon_nb.train_local(**ARGS, data=(x, y))
    check_equal(pooled_cluster_2, ref, {**ARGS, "data": (x, y)}, loss_tol=1e-5, param_tol=1e-5)
    items = [(row[FEATURES].to_numpy(), row[TARGETS].to_numpy()) for _, row in table.iterrows()]
    bag = db.from_sequence(items, partition_size=101)  # 4 partitions
    ref = axon_nb.train_local(**ARGS, data=bag)
    check_equal(pooled_cluster_2, ref, {**ARGS, "data": bag}, loss_tol=1e-5, param_tol=1e-5)


def test_bad_collections_say_what_is_wrong_and_leave_nothing(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    df = frame()
    client = pooled_cluster_2.dask()
    held = set(client.who_has())  # the last run's rows
    with pytest.raises(ValueError, match=r"no column 'nope'; the columns are \['f0'"):
        pooled_cluster_2.train(**ARGS, data=df, columns=(FEATURES, "nope"))
    with pytest.raises(ValueError, match="needs columns=\\(features, target\\)"):
        pooled_cluster_2.train(**ARGS, data=df)
    with pytest.raises(ValueError, match=r"3 partitions; 2 data-parallel ranks .*npartitions=4"):
        pooled_cluster_2.train(**ARGS, data=frame(partitions=3), columns=(FEATURES, TARGETS))
    with pytest.raises(ValueError, match="each of the 2 data-parallel ranks gets 10, fewer"):
        pooled_cluster_2.train(**ARGS, data=frame(rows=20), columns=(FEATURES, TARGETS))
    assert _settled(client, held)  # nothing computed for them was left behind
    # a collection persisted through a client that was closed since
    gone = client.persist(df)
    client.close()
    with pytest.raises(ValueError, match="its dask client was closed"):
        pooled_cluster_2.train(**ARGS, data=gone, columns=(FEATURES, TARGETS))
    result = pooled_cluster_2.train(**ARGS, data=df, columns=(FEATURES, TARGETS))  # a new client
    assert result.step == ARGS["steps"]


def _settled(client: Any, held: set[Any], seconds: float = 10) -> bool:
    """Whether the client holds exactly ``held`` (releases reach the scheduler shortly)."""
    import time

    deadline = time.monotonic() + seconds
    while set(client.who_has()) != held and time.monotonic() < deadline:
        time.sleep(0.1)
    return set(client.who_has()) == held


def test_dask_comes_back_after_a_restart(pooled_cluster_2: axon_nb.Cluster) -> None:
    before = pooled_cluster_2.dask()
    pooled_cluster_2.restart()
    after = pooled_cluster_2.dask()
    assert after is not before and after.status == "running"
    assert sorted(workers_by_rank(after)) == [0, 1]
    assert before.status != "running"


def test_the_ranks_workers_are_found_when_the_clients_refresh_empties_its_cache(
    pooled_cluster_2: axon_nb.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI failure of 2026-11-29: ``client.scheduler_info()`` returns the client's cached
    identity, and the client's own 2-second refresh (``n_workers=0``) replaces it with one
    listing no workers; here that refresh lands right after every update."""
    client = pooled_cluster_2.dask()
    update = client._update_scheduler_info

    async def then_refreshed(n_workers: int = 0) -> None:
        await update(n_workers=n_workers)
        await update(n_workers=0)  # what the periodic refresh stores

    monkeypatch.setattr(client, "_update_scheduler_info", then_refreshed)
    assert client.scheduler_info(n_workers=-1)["workers"] == {}  # the race, made certain
    assert sorted(workers_by_rank(client)) == [0, 1]
    assert pooled_cluster_2.dask() is client  # (its check of the workers holds too)


def _status(link: str, route: str) -> int:
    parts = urlsplit(link)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    connection.request("GET", route)
    return connection.getresponse().status


def test_the_dask_dashboard_is_off_unless_asked_for_and_then_on_loopback(
    pooled_cluster_2: axon_nb.Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    client = pooled_cluster_2.dask()
    # dask's HTTP server listens (on loopback) but serves nothing: no dashboard, health,
    # call stacks, logs or metrics
    assert urlsplit(client.dashboard_link).hostname == "127.0.0.1"
    for route in ("/status", "/health", "/info/main/workers.html", "/metrics", "/sidecar"):
        assert _status(client.dashboard_link, route) == 404, route
    with_dashboard = pooled_cluster_2.dask(dashboard=True)
    said = capsys.readouterr().out
    link = with_dashboard.dashboard_link
    assert f"dashboard on {link} (loopback only)" in said and "TLS" in said
    assert urlsplit(link).hostname == "127.0.0.1"
    assert _status(link, "/status") == 200
    assert dask.compute(da.ones(10, chunks=5).sum(), scheduler=with_dashboard)[0] == 10
    assert pooled_cluster_2.dask() is with_dashboard  # kept while it serves
