"""``cluster.bandwidth``: nccl-tests' figures for every collective on the live ranks."""

from __future__ import annotations

import pytest

import axon_nb
from axon_nb.cluster.bandwidth import COLLECTIVES, parse_sizes

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def test_every_collective_gets_time_algbw_and_busbw(pooled_cluster_4: axon_nb.Cluster) -> None:
    report = pooled_cluster_4.bandwidth(sizes="4K:64K", iters=3, warmup=1)
    assert pooled_cluster_4.bandwidth_results is report
    assert {(r["collective"], r["bytes"]) for r in report.rows} == {
        (c, s) for c in COLLECTIVES for s in (4096, 8192, 16384, 32768, 65536)
    }
    factors = {
        "all_reduce": 1.5,
        "all_gather": 0.75,
        "reduce_scatter": 0.75,
        "all_to_all": 0.75,
        "broadcast": 1.0,
        "send_recv": 1.0,
    }  # nccl-tests, n = 4
    for r in report.rows:
        assert r["axis"] == "world" and r["ranks"] == 4 and r["time_s"] > 0
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_s"])
        assert r["busbw"] == pytest.approx(r["algbw"] * factors[r["collective"]])
    assert report.busbw("all_reduce", 60_000) == next(
        r["busbw"] for r in report.rows if r["collective"] == "all_reduce" and r["bytes"] == 65536
    )
    text, page = str(report), report._repr_html_()
    assert text.count("all_gather") == 5 and "GB/s" in text
    assert "<svg" in page and page.count("<tr>") == len(report.rows) + 1


def test_sizes_and_collectives_are_checked(pooled_cluster_4: axon_nb.Cluster) -> None:
    assert parse_sizes("1K:8K") == [1024, 2048, 4096, 8192]
    assert parse_sizes("64M:64M") == [2**26]
    with pytest.raises(ValueError, match="first size is larger than the last"):
        pooled_cluster_4.bandwidth(sizes="8K:1K")
    with pytest.raises(ValueError, match="sizes must look like 1K:256M"):
        pooled_cluster_4.bandwidth(sizes="1K")
    with pytest.raises(ValueError, match=r"between 4 bytes and 8G, got \[2\]"):
        pooled_cluster_4.bandwidth(sizes=[2, 1024])
    with pytest.raises(ValueError, match=r"unknown collective\(s\) \['gather'\]"):
        pooled_cluster_4.bandwidth(["all_reduce", "gather"])
    with pytest.raises(ValueError, match="iters must be an integer >= 1"):
        pooled_cluster_4.bandwidth(iters=0)
    assert pooled_cluster_4.run(lambda: 1, stream=False) == [1, 1, 1, 1]  # nothing was left running
