"""An experiment for issue 23 item 8: what would engines forked from a warm process save?

A rank's engine spends most of its start importing torch (and ipyparallel, and axon_nb's
rank modules). Here a warm process imports them once, without touching MPI, and forks each
engine on request. What ``mpiexec`` (gforker) starts per rank is a small stub: it hands its
standard streams and its ``PMI_FD`` socket to the warm process over a Unix socket
(``SCM_RIGHTS``), forwards signals to the forked engine, and exits with its exit code.

This is not how axon_nb starts engines: it leaves out what a product needs (a forked engine
outside its rank parent's tree, as the stop path, the reaper and ``RankProcesses`` expect;
the warm process's lifetime; reseeding). It measures the saving, in the same run:

- plain: ``Cluster(n=2).start()``, one cell, ``stop()`` as axon_nb does them;
- forked: the same with ``launchers.engine_cmd`` pointed at the stub.

Each row is the CPU of this process and everything it waited for (the warm process
included, its preloading excluded). The last line is the ratio of medians (forked / plain).

    python benchmarks/forked_engines.py [--ranks 2] [--repeats 4]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOCKET_ENV = "AXON_NB_WARM_ENGINES"
"""Where the stub finds the warm process (set by the measuring process)."""


def _cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and of the children it has waited for."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _become_engine(message: dict, fds: list[int]) -> None:
    """(In the forked child) take the stub's descriptors at their numbers, its environment
    and arguments, and run the engine; never returns."""
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]  # out of the targets' way
    for fd in fds:
        os.close(fd)
    for number, fd in zip(message["fd_numbers"], moved, strict=True):
        os.dup2(fd, number)
    for fd in moved:
        os.close(fd)
    os.environ.clear()
    os.environ.update(message["env"])
    os.chdir(message["cwd"])
    sys.argv = message["argv"]
    code = 0
    try:
        from axon_nb.rank.world import engine

        engine.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(path: str) -> None:
    """The warm process: import what an engine imports, then fork one per connection."""
    import ipyparallel.engine.app  # noqa: F401
    import mpi4py  # noqa: F401  (the package only: MPI is initialized by the engine)
    import torch.distributed  # noqa: F401

    import axon_nb.rank.entry
    import axon_nb.rank.world.bootstrap  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    stubs: dict[int, socket.socket] = {}  # engine pid -> its stub's connection
    while True:
        readable, _, _ = select.select([listener, *stubs.values()], [], [], 0.2)
        with contextlib.suppress(ChildProcessError):
            while (ended := os.waitpid(-1, os.WNOHANG))[0]:
                stub = stubs.pop(ended[0], None)
                if stub is not None:
                    with contextlib.suppress(OSError):
                        code = os.waitstatus_to_exitcode(ended[1])
                        stub.sendall(json.dumps({"exit": code}).encode() + b"\n")
                    stub.close()
        for ready in readable:
            if ready is listener:
                stub, _ = listener.accept()
                data, fds, _, _ = socket.recv_fds(stub, 1 << 20, 16)
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in [stub, *stubs.values()]:
                        other.close()
                    _become_engine(json.loads(data), fds)
                for fd in fds:
                    os.close(fd)
                stub.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                stubs[pid] = stub
            elif not ready.recv(1, socket.MSG_PEEK):  # its stub is gone: so is the engine
                for pid, stub in list(stubs.items()):
                    if stub is ready:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)


def stub(argv: list[str]) -> int:
    """What ``mpiexec`` starts per rank: have the warm process fork the engine, and wait."""
    numbers = [0, 1, 2]
    if "PMI_FD" in os.environ:
        numbers.append(int(os.environ["PMI_FD"]))
    from axon_nb.rank.world.launch import _engine_output  # as the rank's parent opens it

    output = _engine_output()
    output = 1 if output is None else output
    connection = socket.socket(socket.AF_UNIX)
    connection.connect(os.environ[SOCKET_ENV])
    message = {
        "argv": ["engine", *argv],
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "fd_numbers": numbers,
    }
    socket.send_fds(connection, [json.dumps(message).encode()], [0, output, output, *numbers[3:]])
    replies = connection.makefile()
    pid = json.loads(replies.readline())["pid"]

    def pass_on(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM if signum == signal.SIGHUP else signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, pass_on)
    line = replies.readline()
    code = json.loads(line)["exit"] if line else 1
    return code if code >= 0 else 128 - code


def measure(ranks: int, repeats: int) -> None:
    import axon_nb
    from axon_nb.cluster import launchers

    plain_cmd = launchers.engine_cmd
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "engines.sock")
        warm = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", path])
        try:
            while not os.path.exists(path):
                time.sleep(0.05)
            time.sleep(1.0)
            os.environ[SOCKET_ENV] = path
            forked_cmd = [sys.executable, os.path.abspath(__file__), "--stub"]
            rows: dict[str, list[float]] = {"plain": [], "forked": []}
            for _ in range(repeats):
                for name in rows:
                    launchers.engine_cmd = plain_cmd if name == "plain" else lambda: forked_cmd
                    before = _cpu_s(os.getpid()) + _cpu_s(warm.pid)
                    with axon_nb.Cluster(n=ranks, oversubscribe=True) as cluster:
                        assert cluster.run(lambda: 1, stream=False) == [1] * ranks
                    time.sleep(1.0)  # the warm process reaps its engines
                    cpu = _cpu_s(os.getpid()) + _cpu_s(warm.pid) - before
                    rows[name].append(cpu)
                    print(f"{name:7s} start, one cell, stop: {cpu:.2f} CPU-s", flush=True)
        finally:
            warm.kill()
            warm.wait()
    plain, forked = (statistics.median(rows[name]) for name in ("plain", "forked"))
    print(f"\n{ranks} ranks, median of {repeats}: plain {plain:.2f} CPU-s, forked {forked:.2f}")
    print(f"ratio forked/plain: {forked / plain:.3f}")


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
        return
    if sys.argv[1:2] == ["--stub"]:
        sys.exit(stub(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    options = parser.parse_args()
    measure(options.ranks, options.repeats)


if __name__ == "__main__":
    main()
