"""Ctrl-C as Jupyter sends it: a real kernel is interrupted while a `%%axon` cell runs."""

from __future__ import annotations

from queue import Empty

import pytest
from jupyter_client.manager import start_new_kernel
from kernel_client import drain, run_cell, shell_reply, wait_for_text

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def test_kernel_interrupt_stops_the_ranks_and_keeps_the_cluster() -> None:
    km, kc = start_new_kernel(kernel_name="python3")
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
