"""The records of detached clusters without a cluster: names and their claims, directories
closed to others, processes told from later ones with their pid, runs that count as running,
the sidebar keys."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from axon_nb.cluster import detached
from axon_nb.cluster.detached_registry import key_of
from axon_nb.errors import AxonError
from axon_nb.server.registry import KEY
from axon_nb.spec.kept_runs import last_step, read_run, run_dir, stream_path


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "runtime"
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(path))
    return path


def test_a_name_is_claimed_once_and_a_stale_one_taken_over(runtime: Path) -> None:
    name, root = detached.claim_name("lab")
    assert name == "lab" and root.is_dir() and oct(root.stat().st_mode & 0o777) == "0o700"
    with pytest.raises(AxonError, match="named 'lab' is running or starting"):
        detached.claim_name("lab")  # being started: no record yet
    detached.write_record(root, {"name": "lab", "keeper_pid": os.getpid(),
                                 "keeper_started": detached.process_start(os.getpid()),
                                 "ranks": [], "options": {"n": 2}, "started_at": 0})  # fmt: skip
    with pytest.raises(AxonError, match="named 'lab' is running or starting"):
        detached.claim_name("lab")  # its keeper runs
    detached.write_record(root, {"name": "lab", "keeper_pid": os.getpid(),
                                 "keeper_started": 1.0, "ranks": []})  # fmt: skip
    assert detached.claim_name("lab")[0] == "lab"  # a later process has that pid: stale
    made_up, _ = detached.claim_name(None)
    assert made_up.startswith("axon-") and made_up != "lab"
    with pytest.raises(ValueError, match="cluster name 'a b'"):
        detached.claim_name("a b")


def test_a_directory_others_could_write_to_is_refused(runtime: Path) -> None:
    runtime.mkdir()
    runtime.chmod(0o777)
    with pytest.raises(AxonError, match="no one else can write to"):
        detached.clusters_dir()
    runtime.chmod(0o700)
    assert detached.clusters_dir() == runtime / "axon-clusters"


def test_a_process_is_told_from_a_later_one_with_its_pid() -> None:
    me, started = os.getpid(), detached.process_start(os.getpid())
    assert detached.same_process(me, started)
    assert not detached.same_process(me, (started or 0) - 100)
    assert not detached.same_process(-1, None) and not detached.same_process(0, None)


def test_an_unknown_name_lists_the_names_there_are(runtime: Path) -> None:
    with pytest.raises(AxonError, match=r"no detached cluster named 'nope' .*you have none"):
        detached.find("nope")


def test_a_run_counts_as_running_once_begun_or_just_sent(tmp_path: Path) -> None:
    directory = run_dir(tmp_path, "model")
    directory.mkdir(parents=True)
    started = {"run": "r1", "steps": 10, "targets": [0, 1], "kernel_pid": 1, "strategy": "DDP()"}
    (directory / "run.json").write_text(json.dumps({**started, "started_at": time.time()}))
    assert read_run(tmp_path, "model", {0: True, 1: True}).running  # just sent
    (directory / "run.json").write_text(json.dumps({**started, "started_at": 0}))
    assert not read_run(tmp_path, "model", {0: True, 1: True}).running  # never arrived
    stream_path(tmp_path, "model", 0).write_text('{"step": 3}\n')
    assert read_run(tmp_path, "model", {0: True, 1: True}).running  # begun
    assert not read_run(tmp_path, "model", {0: False, 1: False}).running  # its ranks are gone


def test_the_last_step_is_read_from_a_long_last_line(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    records = [{"step": i, "loss": 0.5} for i in range(5000)]  # a line of ~100 KB
    path.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 7, "records": records}))
    assert last_step(path) == 7


def test_sidebar_keys_are_one_per_name() -> None:
    keys = {key_of(n) for n in ("a.b", "a_b", "a_db", "a__b")}
    assert len(keys) == 4 and all(KEY.fullmatch(k) for k in keys)


def test_a_signal_ends_the_keepers_nap_at_once() -> None:
    """A stopping kernel SIGTERMs the keeper and waits for it to exit: the keeper must not
    sleep out its poll first (it did, for up to a second of every detached stop)."""
    import signal
    import threading

    from axon_nb.cluster import keeper
    from axon_nb.spec.signals import wakeup_pipe

    old = signal.set_wakeup_fd(-1)
    woken, _ = wakeup_pipe()
    before = signal.signal(signal.SIGUSR1, lambda *_: None)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        started = time.monotonic()
        timer.start()
        keeper._nap(woken, 60.0)
        assert time.monotonic() - started < 30.0  # (60 s without the wake-up)
        started = time.monotonic()
        keeper._nap(woken, 0.1)  # the wake-up was read: the next nap is a whole one
        assert time.monotonic() - started >= 0.1
    finally:
        timer.cancel()
        os.close(signal.set_wakeup_fd(old))  # (the pipe's write end)
        signal.signal(signal.SIGUSR1, before)
        os.close(woken)
