"""Runs that outlive the notebook: a detached cluster survives its kernel (SIGKILLed mid-run),
any kernel of the same user attaches and finds the whole run, two kernels attach at once, an
idle detached cluster and one whose keeper died end, and bad input says what is wrong. Real
Jupyter kernels (jupyter_client) throughout."""

from __future__ import annotations

import json
import os
import secrets
import signal
import time

import psutil
import pytest
from helpers import wait_gone
from jupyter_client.manager import start_new_kernel
from kernel_client import run_cell

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

ARGS = "model=make_mlp, data=make_data(), loss={loss}, steps={steps}, batch_size=32, seed=3"


def _name() -> str:
    return f"t-{secrets.token_hex(3)}"


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
    km, kc = start_new_kernel(kernel_name="python3")
    _ok(kc, "%load_ext axon_nb\nimport axon_nb, time\nfrom models import *")
    return km, kc


def test_a_run_outlives_its_killed_kernel_and_an_attached_kernel_finds_all_of_it() -> None:
    name = _name()
    km, kc = _kernel()
    try:
        _ok(kc, f"%axon_cluster 2 --detach --name {name} --idle-timeout 300")
        _ok(kc, "%%axon\nmarker = 41 + rank")  # a name set on the ranks
        loss = "slow_mse(0.02, say_at=150, text='said while no kernel was there')"
        _ok(kc, f"cluster = axon_nb.current_cluster()\n"
                f"h = cluster.train({ARGS.format(loss=loss, steps=400)}, block=False)")  # fmt: skip
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
        _ok(kc, "while axon_nb.clusters()[0].runs[0].step < 160: time.sleep(0.05)")
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
        assert _value(kc, "[r['step'] for r in result.history]") == list(range(1, 401))
        gap = _value(
            kc,
            f"(lambda ref: max(abs(a - b) for a, b in zip(result.losses, ref.losses)))("
            f"axon_nb.train_local({ARGS.format(loss='mse', steps=400)}))",
        )
        assert gap < 1e-5
        assert "[rank 1] 42" in _ok(kc, "%%axon\nprint(marker)")  # names of earlier cells
        assert _value(kc, "cluster.evaluate(make_data(), loss=mse, batch_size=64)['loss'] "
                          "< result.losses[0]") is True  # fmt: skip
        started = time.monotonic()
        _ok(kc, "%axon_cluster --stop")
        assert wait_gone(_processes(record), 10) == []
        assert time.monotonic() - started < 10
        assert name not in _ok(kc, "%axon_cluster --list")
    finally:
        km.shutdown_kernel(now=True)
