"""Ctrl-C as Jupyter sends it: a real kernel is interrupted while a `%%axon` cell runs. And
the headless kernels (``make demo``, the tests) are reached on private IPC sockets."""

from __future__ import annotations

import stat
import tempfile
from pathlib import Path
from queue import Empty

import pytest
from kernel_client import drain, run_cell, shell_reply, wait_for_text

from axon_nb.notebooks import ipc_kernel_options, start_kernel

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def test_kernel_interrupt_stops_the_ranks_and_keeps_the_cluster() -> None:
    km, kc = start_kernel()
    try:
        assert run_cell(kc, "%load_ext axon_nb\n%axon_cluster 2 --timeout 60")[0] == "ok"
        loop = (
            "%%axon\nimport torch, torch.distributed as dist\nprint('looping', flush=True)\n"
            "while True:\n    time_ = 0\n"
        )
        # (not stop_on_error: ipykernel 7 would abort the next request if it came before the
        # kernel's own "stop aborting" message, which a loaded machine can delay)
        msg_id = kc.execute(loop, stop_on_error=False)
        wait_for_text(kc, msg_id, "looping", timeout=60)  # the cell runs on the ranks
        km.interrupt_kernel()
        try:
            reply = shell_reply(kc, msg_id, timeout=60)
        except Empty:  # (seen twice in ten full runs: say what the kernel printed meanwhile)
            pytest.fail(f"no reply 60 s after the interrupt; the cell printed: {drain(kc)!r}")
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        status, text = run_cell(
            kc, "%%axon\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item())"
        )
        assert status == "ok" and "[rank 1] 2.0" in text
        assert run_cell(kc, "%axon_cluster --stop")[0] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def test_headless_kernels_are_reached_on_private_ipc_sockets_not_tcp_ports() -> None:
    # Over TCP the manager picks free ports and the kernel binds them a moment later; CI saw
    # another process's connection take one in between ("Address already in use", the kernel
    # dead before kernel_info). `make demo`, the docs' notebooks and these tests use IPC.
    km, kc = start_kernel()
    try:
        assert run_cell(kc, "print(6 * 7)") == ("ok", "42\n")
        # (the kernel's own output pipe binds a TCP port atomically; only the channels raced)
        sockets = sorted(Path(km.connection_file).parent.glob(Path(km.ip).name + "-*"))
        assert len(sockets) == 5 and all(stat.S_ISSOCK(s.stat().st_mode) for s in sockets)
        assert Path(km.ip).parent.stat().st_mode & 0o077 == 0  # axon-kernels: owner-only
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert not any(s.exists() for s in sockets)


def test_a_runtime_dir_too_deep_for_a_socket_path_or_open_to_others_falls_back_to_tcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = tmp_path / ("d" * 40) / ("e" * 40)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(deep))
    assert ipc_kernel_options() == {} and not deep.exists()
    with tempfile.TemporaryDirectory(prefix="r") as short:  # (tmp_path may be deep itself)
        open_to_others = Path(short, "shared")
        open_to_others.mkdir()
        open_to_others.chmod(0o777)
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(open_to_others))
        assert ipc_kernel_options() == {}
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", f"{short}/r")
        options = ipc_kernel_options()
        assert options["transport"] == "ipc"
        assert Path(short, "r", "axon-kernels").stat().st_mode & 0o777 == 0o700
