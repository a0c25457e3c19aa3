"""The Axon sidebar's API on a real Jupyter server (pytest-jupyter): listing, one cluster's
state, each control, and refusals (no token, unknown cluster, unknown action, a directory
that is not owner-only)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from typing import Any

import pytest
import tornado.httpclient

from axon_nb.cluster.lab_registry import ACTIONS, registry_dir

pytestmark = pytest.mark.timeout(120)


def _entry(
    key: str, *, pid: int | None = None, updated: float | None = None, run: Any = None
) -> dict[str, Any]:
    state = {"key": key, "pid": pid or os.getpid(), "updated": updated or time.time(),
             "ranks": 2, "status": "running", "run": run}  # fmt: skip
    (registry_dir() / f"cluster-{key}.json").write_text(json.dumps(state))
    return state


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)  # fmt: skip


async def test_lists_live_clusters_only(jp_fetch: Any) -> None:
    _entry("k1-aaaa")
    _entry("k2-dead", pid=_dead_pid())
    _entry("k3-stale", updated=time.time() - 60)
    response = await jp_fetch("axon-nb", "clusters")
    assert response.code == 200
    assert [c["key"] for c in json.loads(response.body)["clusters"]] == ["k1-aaaa"]
    one = json.loads((await jp_fetch("axon-nb", "clusters", "k1-aaaa")).body)
    assert one["ranks"] == 2


async def test_a_runs_layout_change_reaches_the_sidebar(jp_fetch: Any) -> None:
    move = {"step": 5, "from": "DDP()", "to": "FSDP()", "seconds": 2.0}
    run = {"name": "model", "strategy": "FSDP()", "losses": [[6, 1.0], [7, 0.9]],
           "layout_changes": [move], "dashboard": {"layout_changes": [move]}}  # fmt: skip
    _entry("k1-aaaa", run=run)
    [cluster] = json.loads((await jp_fetch("axon-nb", "clusters")).body)["clusters"]
    assert cluster["run"]["layout_changes"] == [move]
    assert cluster["run"]["dashboard"]["layout_changes"] == [move]  # the dashboard tab's


@pytest.mark.parametrize("action", ACTIONS)
async def test_each_control_writes_an_owner_only_request(jp_fetch: Any, action: str) -> None:
    _entry("k1-aaaa")
    response = await jp_fetch("axon-nb", "clusters", "k1-aaaa", action, method="POST", body="")
    assert response.code == 202 and json.loads(response.body)["queued"] is True
    [control] = list(registry_dir().glob("control-k1-aaaa-*.json"))
    assert json.loads(control.read_text())["action"] == action
    assert stat.S_IMODE(control.stat().st_mode) == 0o600


async def test_refusals_say_why(jp_fetch: Any) -> None:
    _entry("k1-aaaa")
    with pytest.raises(tornado.httpclient.HTTPClientError) as e:
        await jp_fetch("axon-nb", "clusters", "k9-none", "stop_run", method="POST", body="")
    assert e.value.code == 404 and b"no running cluster 'k9-none'" in e.value.response.body
    with pytest.raises(tornado.httpclient.HTTPClientError) as e:
        await jp_fetch("axon-nb", "clusters", "k1-aaaa", "explode", method="POST", body="")
    assert e.value.code == 400 and b"unknown action 'explode'" in e.value.response.body
    assert not list(registry_dir().glob("control-*"))


async def test_no_token_no_data(jp_fetch: Any) -> None:
    _entry("k1-aaaa")
    with pytest.raises(tornado.httpclient.HTTPClientError) as e:
        await jp_fetch("axon-nb", "clusters", headers={"Authorization": ""})
    assert e.value.code == 403
    with pytest.raises(tornado.httpclient.HTTPClientError) as e:  # no token, no XSRF cookie
        await jp_fetch("axon-nb", "clusters", "k1-aaaa", "stop_cluster", method="POST", body="",
                       headers={"Authorization": ""})  # fmt: skip
    assert e.value.code == 403
    assert not list(registry_dir().glob("control-*"))


async def test_a_directory_others_can_enter_is_refused(jp_fetch: Any) -> None:
    _entry("k1-aaaa")
    registry_dir().chmod(0o755)
    with pytest.raises(tornado.httpclient.HTTPClientError) as e:
        await jp_fetch("axon-nb", "clusters")
    assert e.value.code == 500 and b"is not owner-only" in e.value.response.body
    assert stat.S_IMODE(registry_dir().stat().st_mode) == 0o700  # (the kernel's side tightens)
