"""Other hosts for tests: Linux network namespaces, each with its own host name (a UTS
namespace), address and a real ``sshd``, joined to this machine by a bridge.

They share this machine's file system, so the same Python environment runs on them, as on a
cluster with a shared home directory. Needs root, ``ip``, ``unshare`` and ``sshd``
(``make test`` installs openssh-server); :func:`missing` says what is absent.

    with NetnsHosts(2) as hosts:          # hosts.addresses == ["10.77.0.2", "10.77.0.3"]
        os.environ["HYDRA_LAUNCHER_EXEC"] = hosts.ssh

Test files that run at once (pytest-xdist) each get a slot of their own, held with a lock:
slot 0 is ``axnb1``... on ``10.77.0.0/24``, slot 1 ``axn1h1``... on ``10.77.1.0/24``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from started import Started

PREFIX = "axnb"
IFACE = "axeth0"
"""The ranks' interface name inside every namespace (``--iface axeth0``)."""


def missing() -> str | None:
    """Why namespaced hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"needs `{tool}`"
    if not Path("/usr/sbin/sshd").exists():
        return "needs sshd (make test installs openssh-server)"
    return None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


SLOTS = 8


def _take_slot() -> tuple[int, int]:
    """A slot no other process holds (its lock file stays open, locked, while held)."""
    for slot in range(SLOTS):
        fd = os.open(f"/run/axnb-netns-{slot}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return slot, fd
    raise RuntimeError(f"all {SLOTS} slots of namespaced hosts are taken")


class NetnsHosts(Started):
    """``n`` namespaced hosts named ``axnb1``..., at ``10.77.0.2``...; this machine is
    ``gateway`` (``10.77.0.1``) on the bridge (in slot 0; see the module's note)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.slot, self._lock = _take_slot()
        prefix = PREFIX if self.slot == 0 else f"axn{self.slot}h"
        subnet = f"10.77.{self.slot}"
        self.names = [f"{prefix}{i + 1}" for i in range(n)]
        self.addresses = [f"{subnet}.{i + 2}" for i in range(n)]
        self.gateway = f"{subnet}.1"
        """This machine's address on the hosts' network."""
        self._subnet, self._veth = subnet, f"axv{self.slot}"
        self._bridge = f"{PREFIX}br{self.slot}"
        self.dir = Path(tempfile.mkdtemp(prefix="axnb-hosts-"))
        self.ssh = str(self.dir / "ssh")
        """An ssh that logs in to these hosts with this test's key (``HYDRA_LAUNCHER_EXEC``)."""
        self._sshd: list[subprocess.Popen[bytes]] = []

    def pids(self, name: str) -> list[int]:
        """Processes whose network namespace is host ``name``'s (sshd included)."""
        out = subprocess.run(
            ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10
        ).stdout
        return [int(p) for p in out.split()]

    def _start(self) -> None:
        self.close(quiet=True)  # what a killed earlier run left
        key = self.dir / "key"
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / "hostkey"))
        (self.dir / "authorized_keys").write_text((self.dir / "key.pub").read_text())
        Path(self.ssh).write_text(
            "#!/bin/sh\nexec ssh -i " + str(key) + " -o StrictHostKeyChecking=no "
            '-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o BatchMode=yes "$@"\n'
        )
        os.chmod(self.ssh, 0o755)
        os.makedirs("/run/sshd", exist_ok=True)
        _run("ip", "link", "add", self._bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self._bridge)
        _run("ip", "link", "set", self._bridge, "up")
        for i, (name, address) in enumerate(zip(self.names, self.addresses, strict=True)):
            veth = f"{self._veth}v{i + 1}"
            _run("ip", "netns", "add", name)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", IFACE, "netns", name)
            _run("ip", "link", "set", veth, "master", self._bridge, "up")
            self._name_service(name)
            inside = ("ip", "netns", "exec", name)
            _run(*inside, "ip", "addr", "add", f"{address}/24", "dev", IFACE)
            _run(*inside, "ip", "link", "set", IFACE, "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "route", "add", "default", "via", self.gateway)
            config = self.dir / f"sshd-{name}.conf"
            config.write_text(
                f"ListenAddress {address}\nHostKey {self.dir / 'hostkey'}\n"
                f"AuthorizedKeysFile {self.dir / 'authorized_keys'}\nPermitRootLogin yes\n"
                "StrictModes no\nUsePAM no\nPasswordAuthentication no\n"
                f"PidFile {self.dir / f'sshd-{name}.pid'}\nAcceptEnv *\n"
            )
            self._sshd.append(
                subprocess.Popen(
                    [
                        *inside,
                        "unshare",
                        "--uts",
                        "sh",
                        "-c",
                        f"hostname {name} && exec /usr/sbin/sshd -D -e -f {config}",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for address in self.addresses:
            self._wait_for_ssh(address)

    def _name_service(self, name: str) -> None:
        """Host ``name`` resolves names from its own hosts file, as a cluster's machines do;
        ``ip netns exec`` mounts ``/etc/netns/NAME/*`` over ``/etc``. Without it, lookups went
        to this machine's name server, which a namespace cannot reach: c10d's reverse lookup of
        each peer waited out the resolver's timeout (10 s of every start)."""
        config = Path("/etc/netns") / name
        config.mkdir(parents=True, exist_ok=True)
        hosts = [f"127.0.0.1 localhost {name}", f"{self.gateway} {socket.gethostname()}"]
        hosts += [f"{a} {n}" for n, a in zip(self.names, self.addresses, strict=True)]
        (config / "hosts").write_text("\n".join(hosts) + "\n")
        # nothing listens there: a name not in the file fails at once
        (config / "resolv.conf").write_text("nameserver 127.0.0.1\n")

    def _wait_for_ssh(self, address: str, seconds: float = 20.0) -> None:
        deadline = time.monotonic() + seconds
        while True:
            done = subprocess.run([self.ssh, address, "hostname"], capture_output=True, timeout=20)
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {address} did not come up: {done.stderr!r}")
            time.sleep(0.2)

    def close(self, quiet: bool = False) -> None:
        """Stop every process in the namespaces, then remove them and the bridge."""
        for name in self.names:
            for pid in self.pids(name) if Path(f"/run/netns/{name}").exists() else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        for proc in self._sshd:
            proc.wait(timeout=10)
        self._sshd = []
        subprocess.run(["ip", "link", "del", self._bridge], capture_output=True, timeout=10)
        if not quiet:
            shutil.rmtree(self.dir, ignore_errors=True)
            os.close(self._lock)  # (the slot is free again)
