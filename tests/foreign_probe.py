"""What a stranger gets from a cluster: run as another user (or from another host) against
every port a cluster listens on, it tries each protocol's way of running code or reading data.

Run by ``tests/test_security.py`` and ``tests/test_hosts.py`` with a Python of that user's
(``/usr/bin/python3`` with the project's environment on ``PYTHONPATH``: nothing of the
cluster's owner but readable library code). Input: one JSON argument::

    {"ports": [["127.0.0.1", 40001], ...], "canary": "/tmp/x/ran", "seconds": 2.0}

For each port it:
- reads what the port says unasked (a greeting);
- ZeroMQ: subscribes to everything (SUB) and listens ``seconds``; sends an ipyparallel
  ``execute_request`` and ``apply_request`` signed with a key of its own from a DEALER, and
  listens for any answer;
- dask: connects a ``distributed.Client`` over ``tcp://`` and over ``tls://`` with
  certificates of its own and, if that ever connects, runs code that creates ``canary``;
- HTTP: GETs every route dask serves (call stacks, logs, metrics, health, the dashboard).

It prints one JSON object: for each ``host:port`` what it got. It never raises for a refusal:
refusals are what the tests hope to see.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import multiprocessing
import os
import select
import signal
import socket
import sys
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from typing import Any

HTTP_ROUTES = [
    "/", "/health", "/status", "/metrics", "/json/identity.json", "/info/main/workers.html",
    "/info/call-stacks/", "/info/logs/", "/sidecar", "/statics/", "/individual-plots.json",
    "/api/v1", "/api/v1/get_workers", "/eventstream", "/system", "/workers",
]  # fmt: skip


def greeting(host: str, port: int) -> str:
    """The first bytes the port sends unasked, as hex (empty if none within 0.5 s)."""
    try:
        with socket.create_connection((host, port), timeout=2) as s:
            s.settimeout(0.5)
            try:
                return s.recv(64).hex()
            except OSError:
                return ""
    except OSError as e:
        return f"connect failed: {e.strerror}"


def _signed(key: bytes, msg_type: str, content: dict, code: str) -> list[bytes]:
    header = {
        "msg_id": uuid.uuid4().hex, "session": uuid.uuid4().hex, "username": "stranger",
        "date": "2026-11-28T00:00:00Z", "msg_type": msg_type, "version": "5.3",
    }  # fmt: skip
    parts = [json.dumps(p).encode() for p in (header, {}, {}, content)]
    signature = hmac.new(key, b"".join(parts), hashlib.sha256).hexdigest().encode()
    frames = [b"<IDS|MSG>", signature, *parts]
    if msg_type == "apply_request":
        frames.append(code.encode())
    return frames


def zmq_probe(host: str, port: int, canary: str, seconds: float) -> dict[str, object]:
    """Bytes received by a subscriber and by a requester that sent signed-looking requests."""
    import zmq

    code = f"open({canary!r}, 'w').write('ran')"
    ctx = zmq.Context()
    got: dict[str, object] = {}
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(f"tcp://{host}:{port}")
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{host}:{port}")
        key = os.urandom(32)
        for msg_type, content in (
            ("execute_request", {"code": code, "silent": False}),
            ("apply_request", {}),
            ("connection_request", {}),
        ):
            frames = _signed(key, msg_type, content, code)
            with contextlib.suppress(zmq.Again):
                dealer.send_multipart(frames, flags=zmq.NOBLOCK)
        received: dict[str, list[bytes]] = {"sub": [], "dealer": []}
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for sock, _ in poller.poll(100):
                name = "sub" if sock is sub else "dealer"
                received[name].extend(sock.recv_multipart())
        got = {name: b"".join(frames).hex()[:2000] for name, frames in received.items()}
        got["bytes"] = sum(len(f) for frames in received.values() for f in frames)
    finally:
        ctx.destroy(linger=0)
    return got


def dask_probe(host: str, port: int, canary: str, scheme: str) -> str:
    """What a ``distributed.Client`` of a stranger got over ``scheme`` (``tcp``, or ``tls``
    with certificates of its own)."""
    import distributed

    def run_code() -> None:
        with open(canary, "w") as f:
            f.write("ran")

    try:
        security = _own_security() if scheme == "tls" else None
        client = distributed.Client(
            f"{scheme}://{host}:{port}", timeout=2, security=security, set_as_default=False
        )
    except BaseException as e:
        return f"refused: {type(e).__name__}: {str(e)[:160]}"
    try:
        client.run(run_code)
        client.run_on_scheduler(run_code)
        return "CONNECTED and ran code"
    except BaseException as e:
        return f"CONNECTED: {type(e).__name__}: {str(e)[:160]}"
    finally:
        client.close(timeout=2)


@functools.cache
def _own_security() -> Any:
    """Certificates of the stranger's own (made once, before the probes fork)."""
    import distributed

    return distributed.Security.temporary()


def http_probe(host: str, port: int) -> dict[str, str]:
    """Each route's status (and the first bytes of a body that came with a 2xx)."""
    import http.client

    out = {}
    for route in HTTP_ROUTES:
        try:
            conn = http.client.HTTPConnection(host, port, timeout=1)
            conn.request("GET", route)
            response = conn.getresponse()
            body = response.read(200)
            status = str(response.status)
            out[route] = status + (f" {body[:80]!r}" if 200 <= response.status < 300 else "")
            conn.close()
        except Exception as e:
            out[route] = f"failed: {type(e).__name__}"
            break  # not HTTP: the other routes would fail the same way
    return out


STEP_S = 8.0
"""A try that has had no answer by then has got nothing (a gloo port, say, waits for a
handshake that a dask client or an HTTP GET never sends)."""


def bounded(fn: Any, *args: Any, silent: Any) -> Any:
    """``fn(*args)`` in a child process, or ``silent`` when it has not returned within
    :data:`STEP_S` (the child is killed)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            out = json.dumps(fn(*args))
        except BaseException as e:
            out = json.dumps(f"failed: {type(e).__name__}: {e}")
        os.write(write_end, out.encode())
        os._exit(0)
    os.close(write_end)
    chunks, deadline = [], time.monotonic() + STEP_S
    with os.fdopen(read_end, "rb") as pipe:
        while True:
            ready, _, _ = select.select([pipe], [], [], max(deadline - time.monotonic(), 0))
            chunk = pipe.read1(65536) if ready else b""
            if not chunk:
                break
            chunks.append(chunk)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks)) if chunks and ready else silent


def probe(host: str, port: int, canary: str, seconds: float) -> dict[str, object]:
    """Every protocol's try against one port."""
    quiet = f"no answer within {STEP_S:.0f} s"
    return {
        "greeting": bounded(greeting, host, port, silent=quiet),
        "zmq": bounded(zmq_probe, host, port, canary, seconds, silent={"bytes": 0}),
        "dask": {
            scheme: bounded(dask_probe, host, port, canary, scheme, silent=f"refused: {quiet}")
            for scheme in ("tcp", "tls")
        },
        "http": bounded(http_probe, host, port, silent={"/": quiet}),
    }


def main() -> None:
    request = json.loads(sys.argv[1])
    canary, seconds = request["canary"], float(request.get("seconds", 2.0))
    ports = [(str(host), int(port)) for host, port in request["ports"]]
    # imported and made once here: each probe is a fork, and on a busy 2-core machine a fresh
    # import of distributed in every one took longer than a step may (a refusal by timeout)
    import distributed  # noqa: F401
    import zmq  # noqa: F401

    _own_security()
    # one process a port, eight at a time (each waits on timeouts, not on the CPU)
    with ProcessPoolExecutor(8, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {f"{h}:{p}": pool.submit(probe, h, p, canary, seconds) for h, p in ports}
        report: dict[str, object] = {where: f.result() for where, f in futures.items()}
    report["canary_exists"] = os.path.exists(canary)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
