"""The environment mybinder builds from ``binder/``, built here the way repo2docker does: a
clean checkout (the files git tracks or would track), a fresh virtual environment of the
system Python (``runtime.txt``: 3.11), ``pip install -r binder/requirements.txt``, then
``binder/postBuild``, and notebooks executed in that environment's own kernel under a
2 GiB memory limit (mybinder's), in a memory cgroup where this machine lets one be made.

Tests never download: the packages come from uv's cache, which ``make`` filled with the
same versions (``pip`` in ``postBuild`` is uv, offline), and the lab extension's built files
are copied from this checkout (building them needs npm's registry). Example::

    env = BinderEnv.build(tmp_path)
    nb, peak = env.execute("examples/quickstart.ipynb", tmp_path / "out.ipynb")
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import nbformat
import psutil

REPO = Path(__file__).resolve().parent.parent
LIMIT_BYTES = 2 << 30
"""mybinder's memory limit per user."""
CGROUPS = Path("/sys/fs/cgroup/memory")
"""Where a cgroup v1 memory controller is mounted (where there is one)."""


class BinderEnv:
    """A built Binder environment: ``root`` the clean checkout, ``python`` its interpreter."""

    def __init__(self, root: Path, python: Path) -> None:
        self.root, self.python = root, python

    @classmethod
    def build(cls, where: Path) -> BinderEnv:
        root = where / "repo"
        _clean_checkout(root)
        uv = shutil.which("uv", path=str(Path(sys.executable).parent))
        assert uv, "uv is not installed in the test environment"
        env_dir = where / "env"
        _run([uv, "venv", "--python", _system_python(), str(env_dir)], root)
        python = env_dir / "bin" / "python"
        # pip's settings on this machine (its indexes, find-links, constraints) as uv's
        # options: what `pip install` here would read (tools/install.py does the same)
        tools = _installer()
        args, uv_env = tools.uv_arguments(tools.pip_settings(Path(sys.executable).parent / "pip"))
        install = [uv, "pip", "install", "--offline", "--python", str(python), *args]
        _run([*install, "-r", "binder/requirements.txt"], root, **uv_env)
        shims = where / "shims"  # postBuild's `pip install ...` is uv's, offline
        shims.mkdir()
        pip = shims / "pip"
        pip.write_text(
            f"#!{sys.executable}\nimport os, sys\n"
            "assert sys.argv[1] == 'install', sys.argv\n"
            "args = [a for a in sys.argv[2:] if a != '--no-cache-dir']\n"
            f"os.execv({uv!r}, {install!r} + args)\n"
        )
        pip.chmod(pip.stat().st_mode | stat.S_IXUSR)
        path = f"{shims}:{env_dir / 'bin'}:{os.environ['PATH']}"
        _run(["bash", "binder/postBuild"], root, PATH=path, **uv_env)
        return cls(root, python)

    def execute(self, notebook: str, output: Path, timeout: float = 600) -> tuple[object, int]:
        """Execute ``notebook`` (relative to the checkout) in this environment's kernel, under
        the memory limit; returns the executed notebook and the peak memory (bytes, the
        proportional set size of every process it started)."""
        env = {**os.environ, "PATH": f"{self.python.parent}:{os.environ['PATH']}"}
        env.pop("VIRTUAL_ENV", None)
        env.pop("PYTHONPATH", None)
        cmd = [str(self.python), "-m", "axon_nb.notebooks", notebook, "--output", str(output)]
        with _memory_limit(LIMIT_BYTES) as enter:
            proc = subprocess.Popen(
                cmd, cwd=self.root, env=env, preexec_fn=enter, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )  # fmt: skip
            peak = _PeakMemory(proc.pid)
            try:
                out, _ = proc.communicate(timeout=timeout)
            finally:
                peak.stop()
                if proc.poll() is None:
                    proc.kill()
        assert proc.returncode == 0, f"{notebook} failed in the Binder environment:\n{out[-6000:]}"
        return nbformat.read(output, as_version=4), peak.bytes


def _installer() -> Any:
    """``tools/install.py`` (how ``make`` passes pip's settings on to uv)."""
    spec = importlib.util.spec_from_file_location("axon_install", REPO / "tools" / "install.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _clean_checkout(root: Path) -> None:
    """The files git tracks or would track (a clean clone of what is committed), and the lab
    extension's built files."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    shutil.copytree(REPO / "axon_nb" / "labextension", root / "axon_nb" / "labextension",
                    dirs_exist_ok=True)  # fmt: skip


def _system_python() -> str:
    """The Python ``runtime.txt`` asks for, as the machine has it."""
    version = (REPO / "binder" / "runtime.txt").read_text().strip().removeprefix("python-")
    found = shutil.which(f"python{version}") or shutil.which("python3")
    assert found, f"no python{version} on this machine"
    return found


def _run(cmd: list[str], cwd: Path, **env: str) -> None:
    done = subprocess.run(cmd, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True)
    assert done.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )


class _memory_limit:
    """A cgroup v1 memory cgroup limited to ``limit`` bytes; ``enter`` (a ``preexec_fn``)
    moves the child into it. Where no cgroup can be made, ``enter`` does nothing (the peak
    is still measured and asserted)."""

    def __init__(self, limit: int) -> None:
        self.path: Path | None = CGROUPS / f"axon-binder-{os.getpid()}-{time.monotonic_ns()}"
        try:
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
        except OSError:
            self.path = None

    def __enter__(self) -> object:
        path = self.path

        def enter() -> None:
            if path is not None:
                (path / "cgroup.procs").write_text(str(os.getpid()))

        return enter

    def __exit__(self, *exc: object) -> None:
        if self.path is not None:
            for _ in range(50):  # (its last processes are on their way out)
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.2)


class _PeakMemory:
    """Samples the proportional set size of ``pid`` and its descendants, keeping the peak."""

    def __init__(self, pid: int) -> None:
        self.bytes = 0
        self._pid = pid
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.5):
            try:
                root = psutil.Process(self._pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            total = 0
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_full_info().pss
            self.bytes = max(self.bytes, total)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)
