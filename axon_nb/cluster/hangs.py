"""Asking busy ranks where they are, and noticing when they stop making progress.

``WatchDir`` is a cluster's owner-only (0700) directory under Jupyter's runtime directory.
The kernel writes a request number into it; every rank's ``axon-watch`` thread
(``rank/observe/watch.py``) answers with its stacks, without the rank's main thread, which
may be busy or stuck. A rank that does not answer in time is sent ``SIGUSR1``, on which
``faulthandler`` dumps its stacks from C. :func:`collect` turns the answers into a
:class:`~axon_nb.cluster.stacks.StackReport`.

``HangWatch`` calls back once when a wait has made no progress for ``hang_timeout`` seconds
(``%axon_cluster N --hang-timeout S``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from axon_nb.cluster.stacks import StackReport, rank_stacks

ANSWER_S = 2.0
"""How long ranks get to answer a stack request (their watch threads poll every 0.15 s)."""
NATIVE_S = 1.0
"""How long a ``faulthandler`` dump of a rank that did not answer may take to appear."""
POLL_S = 0.05
"""How often the kernel looks for answers."""


class WatchDir:
    """The directory through which the kernel asks one cluster's ranks for their stacks.

    Example::

        watch = WatchDir.create()
        # ... ranks started with BootstrapSpec(watch_dir=str(watch.path)) ...
        answers = watch.ask([0, 1])      # {rank: the rank's JSON answer}
        watch.remove()
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._number = 0

    @classmethod
    def create(cls) -> WatchDir:
        """A fresh directory only this user can read, under Jupyter's runtime directory."""
        from jupyter_core.paths import jupyter_runtime_dir

        base = Path(jupyter_runtime_dir())
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        return cls(Path(tempfile.mkdtemp(prefix="axon-watch-", dir=base)))  # mode 0700

    def remove(self) -> None:
        """Delete the directory (the ranks' watch threads end with it)."""
        shutil.rmtree(self.path, ignore_errors=True)

    def ask(self, ranks: list[int], timeout: float = ANSWER_S) -> dict[int, dict]:
        """Request stacks and wait up to ``timeout`` for ``ranks``' answers; those that came."""
        with self._lock:
            self._number += 1
            number = self._number
            partial = self.path / "request.partial"
            partial.write_text(str(number))
            os.replace(partial, self.path / "request")
        answers: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while True:
            for rank in ranks:
                if rank not in answers:
                    data = self._read_answer(rank)
                    if data is not None and data.get("request", 0) >= number:
                        answers[rank] = data
            if len(answers) == len(ranks) or time.monotonic() > deadline:
                return answers
            time.sleep(POLL_S)

    def native_sizes(self, ranks: list[int]) -> dict[int, int]:
        """Current sizes of the ranks' ``faulthandler`` files (a new dump is appended)."""
        return {r: _size(self.path / f"native-{r}.txt") for r in ranks}

    def native_since(self, sizes: dict[int, int], timeout: float = NATIVE_S) -> dict[int, str]:
        """What each rank's ``faulthandler`` appended after ``sizes``, waiting for it to end."""
        deadline = time.monotonic() + timeout
        seen: dict[int, int] = {}
        while time.monotonic() < deadline:
            now = {r: _size(self.path / f"native-{r}.txt") for r in sizes}
            grown = {r for r, n in now.items() if n > sizes[r]}
            if grown == set(sizes) and now == seen:  # every dump came, and none still grows
                break
            seen = now
            time.sleep(POLL_S * 2)
        dumps = {}
        for rank, start in sizes.items():
            with open(self.path / f"native-{rank}.txt", "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace").strip()
            if text:
                dumps[rank] = text
        return dumps

    def _read_answer(self, rank: int) -> dict | None:
        try:
            return json.loads((self.path / f"stacks-{rank}.json").read_text())
        except (OSError, ValueError):
            return None


def collect(
    watch: WatchDir,
    ranks: list[int],
    *,
    signal_native: Callable[[list[int]], object] | None = None,
    timeout: float = ANSWER_S,
) -> StackReport:
    """Every rank's stacks now; ranks that do not answer get ``signal_native`` (SIGUSR1)."""
    taken_at = time.time()
    answers = watch.ask(ranks, timeout)
    errors = {r: a["error"] for r, a in answers.items() if "error" in a}
    missing = [r for r in ranks if r not in answers]
    native: dict[int, str] = {}
    if missing and signal_native is not None:
        sizes = watch.native_sizes(missing)
        signal_native(missing)
        native = watch.native_since(sizes)
    return StackReport(
        ranks={r: rank_stacks(a) for r, a in answers.items() if "error" not in a},
        missing=tuple(missing),
        native=native,
        errors=errors,
        taken_at=taken_at,
    )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@dataclass
class HangWatch:
    """Calls ``on_hang`` once when the progress token stays the same for ``timeout_s``.

    It fires again only after progress resumed. Example::

        watch = HangWatch(300, on_hang=lambda seconds: print(cluster.stacks()))
        while waiting:
            watch.check(steps_so_far)
    """

    timeout_s: float
    """Seconds without progress that count as a hang."""
    on_hang: Callable[[float], None]
    """Called with the seconds since the last progress."""
    _token: object = field(default=None, init=False)
    _since: float = field(default_factory=time.monotonic, init=False)
    _fired: bool = field(default=False, init=False)

    def check(self, token: object) -> None:
        """Note the progress so far (anything that changes with progress); call ``on_hang``
        if it has not changed for ``timeout_s``."""
        now = time.monotonic()
        if token != self._token:
            self._token, self._since, self._fired = token, now, False
        elif not self._fired and now - self._since >= self.timeout_s:
            self._fired = True
            self.on_hang(now - self._since)
