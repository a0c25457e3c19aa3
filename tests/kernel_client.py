"""Talking to a real Jupyter kernel through its client (``jupyter_client``): run a cell, read
its output and its reply."""

from __future__ import annotations

import time
from queue import Empty
from typing import Any


def run_cell(kc: Any, code: str, timeout: float = 120, *, errors: bool = False) -> tuple[str, str]:
    """Execute ``code``; return (status, all stream text, with ``errors`` each error's name
    and value too).

    Example::

        km, kc = start_kernel()  # (axon_nb.notebooks)
        status, text = run_cell(kc, "print(1)")  # ("ok", "1\\n")
    """
    msg_id = kc.execute(code)
    text = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        if msg["msg_type"] == "error" and errors:
            text.append(f"{msg['content']['ename']}: {msg['content']['evalue']}\n")
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    return shell_reply(kc, msg_id, timeout)["content"]["status"], "".join(text)


def wait_for_text(kc: Any, msg_id: str, text: str, timeout: float) -> None:
    """Read the output of request ``msg_id`` until ``text`` appears in it."""
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.1))
        if msg["parent_header"].get("msg_id") != msg_id or msg["msg_type"] != "stream":
            continue
        if text in msg["content"]["text"]:
            return


def shell_reply(kc: Any, msg_id: str, timeout: float) -> dict:
    """The shell reply to ``msg_id`` (skipping replies to earlier requests, such as the
    kernel_info request made while the kernel started)."""
    while True:
        reply = kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply


def drain(kc: Any) -> str:
    """The stream text and errors waiting on the kernel's IOPub channel."""
    text = []
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except Empty:
            return "".join(text)
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            text.append(f"{msg['content']['ename']}: {msg['content']['evalue']}\n")
