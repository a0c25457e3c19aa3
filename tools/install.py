"""Install axon_nb with its extras into a virtual environment, as ``pip install -e`` would.

``make`` runs it (``python tools/install.py .venv "torch==2.13.0" dev,hf,track``). It installs
with uv, which resolves and unpacks in parallel: the same versions as pip in 16 s against
pip's 211 s on a 2-core machine. Neither compiles the 19,800 modules' bytecode (38 s more):
each module compiles when a process first imports it, and ``make`` lets processes write it
(the Makefile's ``unexport PYTHONDONTWRITEBYTECODE``). uv reads no pip settings, so the
ones pip has here (its indexes, find-links, constraints, certificate and timeout, from
``pip config list``, files and ``PIP_*`` variables alike) are passed on; without any, both
use PyPI. Where uv cannot be installed or fails, pip installs as before, and the reason is
printed.

    python tools/install.py .venv "torch==2.13.0" dev,hf,track
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LEAVE_OUT = Path(__file__).resolve().parent / "leave_out.txt"
"""Requirements uv drops (each with its reason); pip, which has no overrides, keeps them."""

# pip's setting -> (uv's option, whether it repeats per value)
_OPTIONS = {
    "index-url": ("--index-url", False),
    "extra-index-url": ("--extra-index-url", True),
    "find-links": ("--find-links", True),
    "constraint": ("--constraint", True),
}


def pip_settings(pip: Path) -> dict[str, str]:
    """pip's settings by name (``find-links``...), whichever section or variable set them."""
    out = subprocess.run(
        [str(pip), "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    settings: dict[str, str] = {}
    from_env: set[str] = set()
    for line in out.splitlines():  # (sorted by key, not by pip's precedence)
        key, sep, value = line.partition("=")
        if not sep:
            continue
        section, _, name = key.rpartition(".")
        if name in from_env:
            continue  # a PIP_* variable wins over every file, as in pip
        try:
            settings[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[name] = value.strip("'\"")
        if section == ":env:":
            from_env.add(name)
    return settings


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's command-line options and environment for pip's ``settings``."""
    args: list[str] = []
    for name, (option, repeats) in _OPTIONS.items():
        values = settings.get(name, "").split() if repeats else [settings.get(name, "")]
        args += [a for value in values if value for a in (option, value)]
    if "extra-index-url" in settings or "find-links" in settings:
        args += ["--index-strategy", "unsafe-best-match"]  # pip looks at every index alike
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on", "t", "y"):
        args.append("--no-index")
    env = {}
    if settings.get("cert"):
        env["SSL_CERT_FILE"] = settings["cert"]
    timeout = settings.get("default-timeout") or settings.get("timeout")
    if timeout:
        env["UV_HTTP_TIMEOUT"] = timeout
    return args, env


def main(venv: str, torch: str, extras: str) -> int:
    bin_dir = Path(venv) / "bin"
    pip, python = bin_dir / "pip", bin_dir / "python"
    project = f"{REPO}[{extras}]" if extras else str(REPO)
    quiet = ["-q"]
    try:
        subprocess.run([str(pip), "install", *quiet, "uv"], check=True)
        args, env = uv_arguments(pip_settings(pip))
        subprocess.run(
            [str(bin_dir / "uv"), "pip", "install", *quiet, "--python", str(python),
             "--override", str(LEAVE_OUT), *args, torch, "-e", project],
            check=True, env={**os.environ, **env},
        )  # fmt: skip
        return 0
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"uv could not install ({err}); installing with pip instead", file=sys.stderr)
    quiet.append("--no-compile")  # (as uv: the modules a process imports compile then)
    subprocess.run([str(pip), "install", *quiet, torch], check=True)
    subprocess.run([str(pip), "install", *quiet, "-e", project, torch], check=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python tools/install.py VENV TORCH_REQUIREMENT EXTRAS")
    sys.exit(main(*sys.argv[1:]))
