"""Runs that outlive the notebook: a detached cluster survives its kernel (SIGKILLed mid-run),
any kernel of the same user attaches and finds the whole run, two kernels attach at once, an
idle detached cluster and one whose keeper died end, and bad input says what is wrong. Real
Jupyter kernels (jupyter_client) throughout."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import kernel_client
import psutil
import pytest
from helpers import wait_gone
from other_users import STRANGER, SYSTEM_PYTHON, as_user, user_env
from other_users import missing as users_missing

from axon_nb.notebooks import start_kernel

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ARGS = "model=make_mlp, data=make_data(), loss={loss}, steps={steps}, batch_size=32, seed=3"


def _name() -> str:
    return f"t-{secrets.token_hex(3)}"


def run_cell(kc, code: str, timeout: float = 120) -> tuple[str, str]:
    """The cell's status and its output, errors included."""
    return kernel_client.run_cell(kc, code, timeout, errors=True)


def _ok(kc, code: str, timeout: float = 120) -> str:
    status, text = run_cell(kc, code, timeout)
    assert status == "ok", text
    return text


def _value(kc, expression: str) -> object:
    """``expression`` evaluated in the kernel, as JSON."""
    text = _ok(kc, f"import json as _j; print('VALUE', _j.dumps({expression}))")
    return json.loads(text.split("VALUE ", 1)[1].splitlines()[0])


def _record(name: str) -> dict:
    from axon_nb.cluster.detached import clusters_dir, read_record

    record = read_record(clusters_dir() / name)
    assert record is not None
    return record


def _processes(record: dict) -> list[int]:
    """Every process of the cluster: ranks, launchers, controller and keeper."""
    pids = [*record["pids"].values(), *record["roots"], record["keeper_pid"]]
    return [p for p in pids if psutil.pid_exists(p)]


def _kernel():
    km, kc = start_kernel()
    _ok(kc, "%load_ext axon_nb\nimport axon_nb, time\nfrom models import *")
    return km, kc


def test_a_run_outlives_its_killed_kernel_and_an_attached_kernel_finds_all_of_it() -> None:
    name = _name()
    km, kc = _kernel()
    try:
        _ok(kc, f"%axon_cluster 2 --detach --name {name} --idle-timeout 300")
        _ok(kc, "%%axon\nmarker = 41 + rank")  # a name set on the ranks
        # fast to step 150, then 450 steps of at least 50 ms: still running at step 160 for
        # as long as the checks below take on a loaded machine
        loss = "slow_mse(0.05, say_at=150, text='said while no kernel was there', after=150)"
        _ok(kc, f"cluster = axon_nb.current_cluster()\n"
                f"h = cluster.train({ARGS.format(loss=loss, steps=600)}, block=False)")  # fmt: skip
        _ok(kc, "while len(h.history) < 20: time.sleep(0.05)")
        record = {**_record(name), "kernel": km.provisioner.pid}
        os.kill(km.provisioner.pid, signal.SIGKILL)  # mid-run
        time.sleep(1)
        assert all(psutil.pid_exists(p) for p in record["pids"].values())
    finally:
        km.cleanup_resources()
    km, kc = _kernel()  # another kernel
    try:
        listed = _ok(kc, "%axon_cluster --list")
        assert name in listed and "model (step" in listed and "running" in listed
        _ok(kc, f"while [c for c in axon_nb.clusters() if c.name == {name!r}][0].runs[0].step "
                "< 160: time.sleep(0.05)")  # fmt: skip
        text = _ok(kc, f"%axon_attach {name}")
        # what the ranks said while no kernel was there: kept, and replayed on attach
        assert "[rank 0] said while no kernel was there" in text
        _ok(kc, "cluster = axon_nb.current_cluster()\nh = cluster.handle('model')")
        history = _value(kc, "[r['step'] for r in h.history]")
        assert history[:3] == [1, 2, 3] and len(history) >= 160  # the whole run, not since attach
        refused = _ok(kc, "try:\n    cluster.run(lambda: 1)\nexcept axon_nb.AxonError as e:\n"
                          "    print('REFUSED', e)")  # fmt: skip
        assert "REFUSED run 'model' (step" in refused and str(record["kernel"]) in refused
        _ok(kc, "result = h.wait()")
        assert _value(kc, "[r['step'] for r in result.history]") == list(range(1, 601))
        # (one thread: two spinning OpenMP threads on a loaded machine took this past 120 s)
        _ok(kc, "import torch\ntorch.set_num_threads(1)")
        gap = _value(
            kc,
            f"(lambda ref: max(abs(a - b) for a, b in zip(result.losses, ref.losses)))("
            f"axon_nb.train_local({ARGS.format(loss='mse', steps=600)}))",
        )
        assert gap < 1e-5
        assert "[rank 1] 42" in _ok(kc, "%%axon\nprint(marker)")  # names of earlier cells
        assert _value(kc, "cluster.evaluate(make_data(), loss=mse, batch_size=64)['loss'] "
                          "< result.losses[0]") is True  # fmt: skip
        # the model goes on: saved, and trained on from where the run ended (resume=True)
        _ok(kc, "import tempfile\nsaved = cluster.save(tempfile.mkdtemp() + '/ckpt')")
        more = ARGS.format(loss="mse", steps=10)
        assert _value(kc, f"cluster.train({more}, resume=True).step") == 610  # 600 + 10 more
        started = time.monotonic()
        _ok(kc, "%axon_cluster --stop")
        assert wait_gone(_processes(record), 10) == []
        assert time.monotonic() - started < 10
        assert name not in _ok(kc, "%axon_cluster --list")
    finally:
        km.shutdown_kernel(now=True)


@pytest.mark.parametrize("stopper", ["attached", "starter"])
def test_two_kernels_attached_at_once_both_see_the_run_and_either_stops_it(stopper: str) -> None:
    name = _name()
    (km_a, kc_a), (km_b, kc_b) = _kernel(), _kernel()
    try:
        _ok(kc_a, f"%axon_cluster 2 --detach --name {name}\ncluster = axon_nb.current_cluster()")
        record = _record(name)
        _ok(kc_b, f"cluster = axon_nb.attach({name!r})")
        listed = _ok(kc_a, "%axon_cluster --list")
        both = sorted([km_a.provisioner.pid, km_b.provisioner.pid])
        assert f"attached: kernel {both[0]}, {both[1]}" in listed
        loss = "slow_mse(0.05)"  # (30 s at least: stopped long before its end)
        _ok(kc_a, f"h = cluster.train({ARGS.format(loss=loss, steps=600)}, block=False)")
        _ok(kc_b, "h = cluster.handle('model')\nwhile len(h.history) < 5: time.sleep(0.05)\n"
                  "first = len(h.history)\ntime.sleep(1.5)")  # fmt: skip
        seen = _value(kc_b, "[first, len(h.history), h.history[0]['step'], h.done]")
        assert seen[0] < seen[1] and seen[2] == 1 and seen[3] is False  # streaming, whole
        refused = _ok(kc_b, "try:\n    cluster.run(lambda: 1)\nexcept axon_nb.AxonError as e:\n"
                            "    print('REFUSED', e)")  # fmt: skip
        assert "REFUSED run 'model' (step" in refused
        assert f"another kernel (pid {km_a.provisioner.pid})" in refused
        assert _value(kc_a, "len(h.history) > 0 and not h.done") is True  # its own run, its own way
        started = time.monotonic()
        _ok(kc_b if stopper == "attached" else kc_a, "cluster.stop()")  # mid-run
        assert wait_gone(_processes(record), 10) == []
        assert time.monotonic() - started < 10
    finally:
        km_a.shutdown_kernel(now=True)
        km_b.shutdown_kernel(now=True)


def test_a_detached_cluster_survives_a_kernel_restart_and_ends_when_idle_with_its_data() -> None:
    km, kc = _kernel()
    try:
        said = _ok(kc, "%axon_cluster 2 --detach --idle-timeout 15")  # a name is made up
        name = said.split("Detached as '", 1)[1].split("'", 1)[0]
        assert name.startswith("axon-") and f"%axon_attach {name}" in said
        data = "make_data(40000)"  # its tensors are shared on the host (/dev/shm)
        _ok(kc, f"axon_nb.current_cluster().train(model=make_mlp, data={data}, loss=mse, "
                "steps=3, batch_size=32)")  # fmt: skip
        record = _record(name)
        km.restart_kernel(now=True)  # Jupyter's restart: SIGKILL to the kernel's process group
        unattached = time.monotonic()
        assert all(psutil.pid_exists(p) for p in _processes(record))
    finally:
        km.shutdown_kernel(now=False)
    rank = psutil.Process(record["pids"]["0"])
    assert any("/dev/shm" in m.path for m in rank.memory_maps())  # holds the shared data
    time.sleep(max(0.0, 10 - (time.monotonic() - unattached)))
    assert time.monotonic() - unattached < 13
    assert all(psutil.pid_exists(p) for p in _processes(record))  # 10 s without a kernel: on
    # ended 15 s after the last kernel left (the stop's own seconds on a loaded machine besides)
    left = 15 + 20 - (time.monotonic() - unattached)
    assert wait_gone(_processes(record), left) == []
    from axon_nb.cluster.detached import clusters

    assert name not in [c.name for c in clusters()]


def test_bad_input_says_what_is_wrong_and_loses_nothing() -> None:
    name = _name()
    km, kc = _kernel()
    try:
        _ok(kc, f"%axon_cluster 2 --detach --name {name}")
        record = _record(name)
        _ok(kc, "%%axon\nkept = rank")
        status, text = run_cell(kc, "%axon_attach no-such-cluster")
        assert status == "error" and "this kernel already has a cluster" in text
        status, text = run_cell(kc, "axon_nb.attach('no-such-cluster')")
        assert status == "error"
        assert "no detached cluster named 'no-such-cluster' on this host (yours: " in text
        assert name in text
        for bad, message in [
            (f"axon_nb.Cluster(n=2, detach=True, name={name!r}).start()",
             f"a detached cluster named {name!r} is running or starting: attach to it with"),
            ("axon_nb.Cluster(n=2, detach=True, name='no spaces')", "cluster name 'no spaces'"),
            ("axon_nb.Cluster(n=2, name='lab')", "name= names a detached cluster: add detach"),
            ("axon_nb.Cluster(n=2, detach=True, idle_timeout=0)", "idle_timeout must be a pos"),
            ("axon_nb.Cluster(n=2, detach=True, hosts='a:1,b:1')", "runs on this host only"),
        ]:  # fmt: skip
            said = _ok(kc, f"try:\n    {bad}\nexcept Exception as e:\n    print('ERR', e)")
            assert message in said, (bad, said)
        status, text = run_cell(kc, "%axon_cluster 2 --detach --idle-timeout 2x")
        assert status == "error" and "a duration like 2h, 30m, 90s or 7200" in text
        # another installation of axon_nb: refused, naming both
        from axon_nb.cluster.detached import clusters_dir, code_hash

        cluster_json = clusters_dir() / name / "cluster.json"
        kept = cluster_json.read_text()
        cluster_json.write_text(kept.replace(record["code_hash"], "0123456789ab"))
        refused = _ok(kc, f"try:\n    axon_nb.attach({name!r})\nexcept axon_nb.AxonError as e:\n"
                          "    print('ERR', e)")  # fmt: skip
        assert "(code 0123456789ab), this kernel has axon_nb" in refused
        assert f"(code {code_hash()})" in refused
        cluster_json.write_text(kept)
        # nothing was lost: the cluster and its names are there
        assert "[rank 1] 1" in _ok(kc, "%%axon\nprint(kept)")
        # another user sees none of this user's clusters and cannot attach
        if users_missing() is None:
            stranger = _as_stranger(name)
            assert stranger["clusters"] == [], stranger  # in their own directory: none
            assert stranger["attach"].startswith("AxonError: no detached cluster named"), stranger
            assert stranger["read"] == "PermissionError", stranger  # ours: closed to them
            assert stranger["list"] == "PermissionError", stranger
            assert stranger["ours"].startswith("PermissionError"), stranger
        # the keeper killed: every rank ends (they may hold GPUs)
        os.kill(record["keeper_pid"], signal.SIGKILL)
        assert wait_gone(_processes(record), 10) == []
    finally:
        km.shutdown_kernel(now=True)


def _as_stranger(name: str) -> dict:
    """What another local user gets: their clusters, an attach to ours, a read of our record."""
    from axon_nb.cluster.detached import clusters_dir

    home = Path(tempfile.mkdtemp(prefix="axon-stranger-"))  # (pytest's are root's only)
    home.chmod(0o777)
    code = textwrap.dedent(f"""
        import json, os, axon_nb
        out = {{"clusters": [c.name for c in axon_nb.clusters()]}}
        try:
            axon_nb.attach({name!r})
            out["attach"] = "attached"
        except Exception as e:
            out["attach"] = f"{{type(e).__name__}}: {{e}}"
        for what, do in [
            ("read", lambda: open({str(clusters_dir() / name / "cluster.json")!r}).read()),
            ("list", lambda: os.listdir({str(clusters_dir())!r})),
        ]:
            try:
                do()
                out[what] = "done"
            except Exception as e:
                out[what] = type(e).__name__
        os.environ["JUPYTER_RUNTIME_DIR"] = {str(clusters_dir().parent)!r}  # ours, pointed at
        try:
            out["ours"] = str(axon_nb.clusters())
        except Exception as e:
            out["ours"] = f"{{type(e).__name__}}: {{e}}"
        print(json.dumps(out))
    """)
    done = subprocess.run(
        as_user(STRANGER, [SYSTEM_PYTHON, "-c", code]),
        env=user_env(home), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    shutil.rmtree(home, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))
