"""``StackReport``: where every rank is, as one compact text (``%axon_stacks``, hang reports).

Built from what each rank's watch thread writes (``axon_nb/rank/observe/watch.py``): every thread's
Python stack and the rank's current or last collective. Ranks are grouped by where they are:
those waiting in the same collective share a line, and each rank elsewhere is shown at its
innermost frame of user code (frames of the standard library, installed packages and axon_nb
are skipped). Ranks that did not answer are listed with what ``faulthandler`` dumped for them.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from axon_nb.ipykernel_sigint import RUNNERS

TASK_FUNCTIONS = frozenset(function for function, _ in RUNNERS)
"""The engine's frames that run a task (``cluster.run``, relayed or not; a ``%%axon`` cell): a
main thread with one is busy, and the frames below the last one are the task's own."""
_LIBRARY_PATHS = ("/site-packages/", "/dist-packages/", "/lib/python3", "/axon_nb/", "<frozen")


_CELL_FILE = re.compile(r"ipykernel_\d+[/\\]\d+\.py$|^<ipython-input-")
"""How IPython names the code of a cell (a ``%%axon`` cell on the ranks)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Frame:
    """One frame of a rank's stack."""

    filename: str
    """Source file (``<ipython-input-...>``-style names for cells)."""
    line: int
    """Line number being run."""
    function: str
    """Function name."""
    source: str
    """That line's source text (empty where unknown)."""
    user: bool
    """False for the standard library, installed packages and axon_nb."""

    def __str__(self) -> str:
        name = "cell" if _CELL_FILE.search(self.filename) else os.path.basename(self.filename)
        return f"{name}:{self.line} in {self.function}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ThreadStack:
    """One thread of a rank: its name and stack, outermost frame first."""

    name: str
    """Thread name (``MainThread`` runs the rank's tasks)."""
    main: bool
    """True for the main thread."""
    frames: tuple[Frame, ...]
    """The stack, outermost first (like a traceback)."""

    def format(self, *, engine: bool = False) -> str:
        """The stack as a traceback-style text; the engine's frames above the task are left
        out unless ``engine``."""
        frames = self.frames if engine else self.task_frames()
        lines = [f"Thread {self.name!r} (most recent call last):"]
        if len(frames) < len(self.frames):
            lines.append(f"  ... {len(self.frames) - len(frames)} frames of the engine ...")
        for f in frames:
            lines.append(f'  File "{f.filename}", line {f.line}, in {f.function}')
            if f.source:
                lines.append(f"    {f.source}")
        return "\n".join(lines)

    def task_frames(self) -> tuple[Frame, ...]:
        """The frames below the engine's last task-running frame (all, where there is none)."""
        last = max((i for i, f in enumerate(self.frames) if f.function in TASK_FUNCTIONS),
                   default=-1)  # fmt: skip
        return self.frames[last + 1 :]


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """A rank's current or last collective (``axon_nb/metrics/collective.py``)."""

    kind: str
    """The ``torch.distributed`` function (``all_reduce``, ``barrier``, ``recv``, ...)."""
    seq: int
    """How many collectives this rank had called, this one included."""
    group: tuple[int, ...] | None
    """Global ranks of its process group; None for the whole world."""
    group_size: int | None
    """Ranks in its group."""
    bytes: int | None
    """Payload this rank handed to it; None where unknown (objects, barriers)."""
    peer: int | None
    """The other rank of a send or receive."""
    async_op: bool
    """Issued with ``async_op=True`` (the wait, if any, comes later)."""
    done: bool
    """Finished (or raised, see ``failed``)."""
    failed: bool
    """It raised (a timeout, or a peer left)."""
    age_s: float
    """Seconds since it started, when the report was taken."""
    main_thread: bool
    """Issued by the rank's main thread (the one running tasks)."""
    backend: str | None = None
    """Its group's backend. On NCCL, ``done`` means handed to the GPU, not finished there."""

    @property
    def waiting(self) -> bool:
        """It has not finished: the rank waits for it (an ``async_op`` one may still overlap
        with compute, but not for long)."""
        return not self.done

    def label(self) -> str:
        """``all_reduce #57 (group of 4, 1.0 KiB)``."""
        parts = []
        if self.peer is not None:
            parts.append(f"peer rank {self.peer}")
        if self.group is not None:
            parts.append(f"group {list(self.group)}")
        elif self.group_size is not None:
            parts.append(f"group of {self.group_size}")
        if self.bytes is not None:
            parts.append(format_bytes(self.bytes))
        if self.async_op:
            parts.append("async")
        detail = f" ({', '.join(parts)})" if parts else ""
        return f"{self.kind} #{self.seq}{detail}"


@dataclass(frozen=True, kw_only=True, slots=True)
class RankStacks:
    """What one rank reported: every thread's stack and its collective."""

    rank: int
    host: str
    pid: int
    threads: tuple[ThreadStack, ...]
    """Every thread but the watch thread, the main thread first."""
    collective: Collective | None
    """The current or last collective; None before the first."""

    @property
    def main(self) -> ThreadStack | None:
        """The main thread, which runs the rank's tasks."""
        return next((t for t in self.threads if t.main), None)

    @property
    def idle(self) -> bool:
        """No task is running (the main thread waits for the next one)."""
        main = self.main
        return main is not None and not any(f.function in TASK_FUNCTIONS for f in main.frames)

    def where(self, depth: int = 2) -> str:
        """The innermost ``depth`` frames of user code on the main thread, innermost first
        (``train.py:42 in load_batch ← train.py:80 in step``). Without user code: the innermost
        frame and the innermost of axon_nb (``graph.py:979 in ... ← loop.py:312 in _step``).
        Frames inside a collective it waits in are left out (the summary names it)."""
        frames = self.main.task_frames() if self.main is not None else ()
        inside = [i for i, f in enumerate(frames) if _is_collective_wrapper(f)]
        if inside and self.collective is not None and self.collective.waiting:
            frames = frames[: inside[-1]]
        user = [f for f in frames if f.user]
        if user:
            chosen = user[-depth:]
        else:
            ours = [f for f in frames[:-1] if _AXON_PATH in _path(f)]
            chosen = [*ours[-1:], *frames[-1:]]
        return " ← ".join(str(f) for f in reversed(chosen)) or "no Python frame"


@dataclass(frozen=True, kw_only=True, slots=True)
class StackReport:
    """Every rank's stacks and collective at one moment; ``str()`` is a compact summary.

    Example::

        report = cluster.stacks()
        print(report)              # ranks 0, 2, 3 wait in all_reduce #57 ...; rank 1 is elsewhere
        print(report.stacks[1])    # rank 1's main-thread stack, traceback style
        report.ranks[1].threads    # every thread of rank 1
    """

    ranks: dict[int, RankStacks]
    """The ranks that answered, by rank."""
    missing: tuple[int, ...] = ()
    """Ranks that did not answer (busy holding the GIL, dead, or without a watch thread)."""
    native: dict[int, str] = field(default_factory=dict)
    """``faulthandler``'s C-level dump of each missing rank, where one came."""
    errors: dict[int, str] = field(default_factory=dict)
    """Ranks whose watch thread answered with an error instead of stacks."""
    taken_at: float = field(default_factory=time.time)
    """``time.time()`` when it was asked for."""

    @property
    def stacks(self) -> dict[int, str]:
        """Each rank's main-thread stack as a traceback-style text (the native dump, for a
        rank that did not answer)."""
        texts = {r: s.main.format() for r, s in self.ranks.items() if s.main is not None}
        texts.update(self.native)
        return dict(sorted(texts.items()))

    def lines(self) -> list[str]:
        """The summary, one line per group of ranks."""
        waiting: dict[str, list[RankStacks]] = {}
        elsewhere: dict[str, list[RankStacks]] = {}
        idle: list[int] = []
        for rank, s in sorted(self.ranks.items()):
            c = s.collective
            if s.idle:
                idle.append(rank)
            elif c is not None and c.waiting:
                waiting.setdefault(c.label(), []).append(s)
            else:
                elsewhere.setdefault(s.where(), []).append(s)
        lines = []
        for label, group in waiting.items():
            age = max(s.collective.age_s for s in group if s.collective is not None)
            wait = "waits" if len(group) == 1 else "wait"
            lines.append(
                f"{_ranks(group)} {wait} in {label} for {age:.0f} s, at {group[0].where(1)}"
            )
        for where, group in elsewhere.items():
            verb = "is" if len(group) == 1 else "are"
            lines.append(f"{_ranks(group)} {verb} elsewhere: {where}{_last(group)}")
        if idle:
            verb = "is" if len(idle) == 1 else "are"
            lines.append(f"{_ranks(idle)} {verb} idle (no task running)")
        for rank, error in sorted(self.errors.items()):
            lines.append(f"rank {rank} could not report its stacks: {error}")
        for rank in self.missing:
            native = native_where(self.native[rank]) if rank in self.native else None
            how = f"; native dump: {native}" if native else "; no native dump came either"
            lines.append(
                f"rank {rank} did not answer (holding the GIL in native code, or dead){how}"
            )
        return lines

    def format(self, *, full: bool = False) -> str:
        """The summary; with ``full``, each rank's main-thread stack after it."""
        stamp = time.strftime("%H:%M:%S", time.localtime(self.taken_at))
        n = len(self.ranks) + len(self.missing) + len(self.errors)
        head = f"Stacks of {n} rank{'s' if n != 1 else ''} at {stamp}:"
        text = [head, *(f"  {line}" for line in self.lines())]
        if full:
            for rank, stack in self.stacks.items():
                text += ["", f"[rank {rank}] {stack}"]
        else:
            text.append("  (main-thread stacks: report.stacks[rank], or %axon_stacks --full)")
        return "\n".join(text)

    def __str__(self) -> str:
        return self.format()

    __repr__ = __str__


def rank_stacks(data: dict[str, Any]) -> RankStacks:
    """A rank's answer (``rank/observe/watch.py``'s JSON) as a :class:`RankStacks`."""
    threads = tuple(
        ThreadStack(
            name=t["name"],
            main=t["main"],
            frames=tuple(
                Frame(filename=f[0], line=f[1], function=f[2], source=f[3], user=f[4])
                for f in t["frames"]
            ),
        )
        for t in data["threads"]
    )
    c = data.get("collective")
    collective = None
    if c is not None:
        collective = Collective(
            kind=c["kind"],
            seq=c["seq"],
            group=tuple(c["group"]) if c["group"] is not None else None,
            group_size=c["group_size"],
            bytes=c["bytes"],
            peer=c["peer"],
            async_op=c["async_op"],
            done=c["done"],
            failed=c["failed"],
            age_s=c["age_s"],
            main_thread=c["main_thread"],
            backend=c.get("backend"),
        )
    return RankStacks(
        rank=data["rank"], host=data["host"], pid=data["pid"], threads=threads,
        collective=collective,
    )  # fmt: skip


_NATIVE_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')


def native_where(dump: str) -> str | None:
    """Where the main thread is in a ``faulthandler`` dump: its innermost frame outside
    libraries (``train.py:12 in step``), else its innermost frame.

    The main thread is the one whose outermost frame is not ``threading``'s bootstrap.
    """
    for block in re.split(r"\n(?=\S)", dump.strip()):
        frames = [m for m in map(_NATIVE_FRAME.match, block.splitlines()) if m]
        if frames and frames[-1]["fn"] not in ("_bootstrap", "_bootstrap_inner"):
            user = [m for m in frames if not any(p in m["file"] for p in _LIBRARY_PATHS)]
            top = (user or frames)[0]  # most recent call first
            return f"{os.path.basename(top['file'])}:{top['line']} in {top['fn']}"
    return None


def format_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_AXON_PATH = "/axon_nb/"


def _path(frame: Frame) -> str:
    return frame.filename.replace(os.sep, "/")


def _is_collective_wrapper(frame: Frame) -> bool:
    """The frame of ``axon_nb/metrics/collective.py``'s wrapper around a collective."""
    return frame.function == "tracked" and _path(frame).endswith("/metrics/collective.py")


def _ranks(items: list[Any]) -> str:
    ranks = [i if isinstance(i, int) else i.rank for i in items]
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _last(group: list[RankStacks]) -> str:
    c = group[0].collective
    if c is None:
        return ""
    gpu = c.backend is not None and "nccl" in c.backend
    done = "handed to the GPU" if gpu else "done"
    state = "failed" if c.failed else done if c.done else "pending"
    return f" (last collective: {c.kind} #{c.seq}, {state})"
