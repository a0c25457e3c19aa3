"""What the ranks show, live in the cell, each rank in its own region of the output.

A rank's displays, display updates, ``clear_output`` and ``\\r`` progress lines act on its
region only: the region is a row of *slots*, each a display of the kernel's with a display id
of its own, namespaced per rank (a rank's ``display_id="x"`` is ``axon-<token>-r<rank>-<n>``
here, so two ranks' ``"x"`` never touch each other). A rank's display fills the next slot; its
``update_display_data`` updates the slots that showed that id (in this cell or an earlier
one, as in Jupyter); ``clear_output`` empties its slots (``wait=True``: when its next output
comes) and from then on its printed text shows in its region too, so that a loop of
``clear_output(wait=True); print(...)`` rewrites one rank's lines only. A line a rank prints
in parts (tqdm's ``\\r`` progress bar, ``print(..., end="")``) shows in a slot of its own
while it grows, and stays there once ended.

Everything else a rank prints goes to the cell's stdout and stderr a line at a time, each
labelled ``[rank N]``, as before. Outside a Jupyter kernel (a terminal, a script) there are
no slots: displays print their text, updates and clears are dropped, lines print once ended.

The ranks' displays, updates and clears reach the kernel on ipyparallel's IO thread (its
message futures' ``iopub_callbacks``); they are queued and shown from the kernel's main
thread, where the cell's output goes, each time the wait loop calls :meth:`LiveOutput.flush`.
Printed text is read from each result's accumulated ``stdout``/``stderr``, whose ended lines
never change (ipyparallel rewrites the last line on ``\\r``), so nothing printed is missed
or shown twice.

Example (what :func:`axon_nb.cluster.waiting.wait_for_ranks` does)::

    live = LiveOutput(parts, sys.stdout, sys.stderr)
    while not done:
        live.flush()
    live.finish()
"""

from __future__ import annotations

import functools
import queue
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, TextIO

import ipyparallel as ipp
from IPython.display import publish_display_data

from axon_nb.widgets.frontend import in_notebook

LIVE_AFTER_S = 0.2
"""A line printed in parts shows in a slot once it has been unended this long (shorter
gaps are a ``print`` whose newline travelled apart)."""
EMPTY: dict[str, Any] = {"text/plain": ""}
"""What an emptied slot shows."""
KEPT_IDS = 10_000
"""How many ranks' display ids the kernel remembers (for updates from later cells)."""

WIDGET = "application/vnd.jupyter.widget-view+json"
"""A widget's view (its model reaches the notebook through ipyparallel's comm relay)."""
SHOWN = ("display_data", "update_display_data", "clear_output")
"""The messages of a rank's that show here (its streams are read from its result)."""

_Arrived = tuple[int, dict[str, Any], dict[str, int]]
"""A rank's message: ``(rank, message, {stream: where its ended lines ended then})``."""

_display_ids: OrderedDict[tuple[int, str | None], list[str]] = OrderedDict()
"""``(rank, the rank's display id)`` -> the kernel's display ids that show it (looked up with
a message's id, which may be missing: None, never stored)."""


@dataclass
class _Line:
    """One rank's stream: how much of its text is done with, and its unended last line."""

    offset: int = 0
    tail: str = ""
    tail_since: float = 0.0
    slot: int | None = None
    shown: str = ""


@dataclass
class _Region:
    """One rank's slots in this cell's output."""

    rank: int
    token: str
    slots: list[str] = field(default_factory=list)
    used: int = 0
    clear_pending: bool = False
    text_in_region: bool = False
    text: str = ""
    text_slot: int | None = None
    lines: dict[str, _Line] = field(default_factory=lambda: {"stdout": _Line(), "stderr": _Line()})

    def take_slot(self) -> tuple[int, bool]:
        """The next free slot, and whether it is reused (updated) rather than new (shown)."""
        reused = self.used < len(self.slots)
        if not reused:
            self.slots.append(f"axon-{self.token}-r{self.rank}-{len(self.slots)}")
        self.used += 1
        return self.used - 1, reused


class LiveOutput:
    """Shows what the ranks of one call print and display, as it comes (see the module).

    ``parts``: the call's per-rank results; :meth:`flush` while waiting, :meth:`finish` once
    they are in (alone, it shows everything at the end)."""

    def __init__(self, parts: dict[int, ipp.AsyncResult], out: TextIO, err: TextIO) -> None:
        self._parts = parts
        self._files = {"stdout": out, "stderr": err}
        self._slots = in_notebook()
        token = uuid.uuid4().hex[:8]
        self._regions = {rank: _Region(rank, token) for rank in parts}
        self._queue: queue.SimpleQueue[_Arrived] = queue.SimpleQueue()
        self._early: list[_Arrived] = []
        self._callbacks: list[tuple[Any, Any]] = []
        for rank, part in parts.items():
            self._listen(rank, part)

    def _listen(self, rank: int, part: ipp.AsyncResult) -> None:
        """Queue the rank's display messages from now on, and take the displays that came
        before (in its result's ``outputs``; a display seen both ways is taken once)."""
        for future in part._children:  # ipyparallel's per-message futures (as its stream_output)
            callback = functools.partial(self._arrived, rank, future.output.metadata)
            future.iopub_callbacks.append(callback)
            self._callbacks.append((future, callback))
        for content in [c for f in part._children for c in list(f.output.metadata["outputs"])]:
            msg = {"header": {"msg_type": "display_data"}, "content": content}
            self._early.append((rank, msg, {"stdout": 0, "stderr": 0}))

    def _arrived(self, rank: int, metadata: dict[str, Any], msg: dict[str, Any]) -> None:
        """(On ipyparallel's IO thread: queued for the main thread, with where each stream's
        ended lines end now, so that lines printed before it show before it.)"""
        if msg["header"]["msg_type"] in SHOWN:
            ended = {name: (metadata[name] or "").rfind("\n") + 1 for name in self._files}
            self._queue.put((rank, msg, ended))

    def flush(self) -> None:
        """Show what came since the last flush."""
        self._show_pending(final=False)

    def finish(self) -> None:
        """Show everything left, unended lines included; called once the results are in."""
        for future, callback in self._callbacks:
            if callback in future.iopub_callbacks:
                future.iopub_callbacks.remove(callback)
        self._callbacks.clear()
        self._show_pending(final=True)

    # -- what came -----------------------------------------------------------------------

    def _show_pending(self, *, final: bool) -> None:
        # The text is read before the queue: a message that came after it is in the queue,
        # so a ``clear_output`` that came before a line is handled before that line shows
        # (read after, a line printed after the clear could show outside the region).
        texts = {rank: {name: _text(part, name) for name in self._files}
                 for rank, part in self._parts.items()}  # fmt: skip
        early_ids = {id(m["content"]) for _, m, _ in self._early}
        messages, self._early = self._early, []
        while True:
            try:
                arrived = self._queue.get_nowait()
            except queue.Empty:
                break
            if id(arrived[1]["content"]) not in early_ids:  # (else it came both ways)
                messages.append(arrived)
        for rank, msg, ended in messages:
            region = self._regions[rank]
            for name, end in ended.items():  # the lines printed before it first
                self._on_text(region, name, _text(self._parts[rank], name)[:end], ended_only=True)
            self._on_message(region, msg)
        for rank, read in texts.items():
            for name, text in read.items():
                self._on_text(self._regions[rank], name, text, final=final)

    def _on_message(self, region: _Region, msg: dict[str, Any]) -> None:
        kind = msg["header"]["msg_type"]
        content = msg.get("content", {})
        if kind == "clear_output":
            region.text_in_region = True  # what it prints next is cleared with the rest
            if content.get("wait"):
                region.clear_pending = True
            else:
                self._clear(region)
            return
        data = _labelled(region.rank, content.get("data", {}))
        metadata = content.get("metadata", {})
        their_id = (content.get("transient") or {}).get("display_id")
        if kind == "update_display_data":
            for display_id in _display_ids.get((region.rank, their_id), []):
                publish_display_data(
                    data, metadata, transient={"display_id": display_id}, update=True
                )
            return
        self._settle_clear(region)
        if not self._slots:
            publish_display_data(data, metadata)
            return
        if WIDGET in data:  # a widget shows no text: its rank goes above it
            self._put(region, None, {"text/plain": f"[rank {region.rank}]"})
        slot = self._put(region, None, data, metadata)
        if their_id is not None:
            _remember(region.rank, str(their_id), region.slots[slot])

    def _on_text(
        self,
        region: _Region,
        name: str,
        text: str,
        *,
        final: bool = False,
        ended_only: bool = False,
    ) -> None:
        """Show the rank's new ended lines, and its unended last line unless ``ended_only``
        (``final``: as an ended one)."""
        line = region.lines[name]
        if line.offset > text.rfind("\n") + 1:  # (read before a message whose lines showed)
            return
        new = text[line.offset :]
        ended, newline, tail = new.rpartition("\n")
        if newline:
            line.offset += len(ended) + 1
            lines = ended.split("\n")
            if line.slot is not None:  # the line that grew in its slot ended: it stays there
                self._show_line(region, line, _last_of(lines[0]))
                line.slot = None
                lines = lines[1:]
            if lines:
                self._print(region, name, lines)
        if ended_only:
            return
        if tail != line.tail:
            line.tail, line.tail_since = tail, time.monotonic()
        if not tail:
            return
        if final:
            line.offset += len(tail)
            line.tail = ""
            if line.slot is not None:
                self._show_line(region, line, _last_of(tail))
                line.slot = None
            else:
                self._print(region, name, [_last_of(tail)])
        elif self._slots and (
            line.slot is not None or time.monotonic() - line.tail_since >= LIVE_AFTER_S
        ):
            self._show_line(region, line, _last_of(tail))

    # -- where it goes -------------------------------------------------------------------

    def _print(self, region: _Region, name: str, lines: list[str]) -> None:
        labelled = "".join(f"[rank {region.rank}] {text}\n" for text in lines)
        if region.text_in_region and self._slots:
            self._settle_clear(region)
            region.text += labelled
            data = {"text/plain": region.text.rstrip("\n")}
            region.text_slot = self._put(region, region.text_slot, data)
            return
        file = self._files[name]
        file.write(labelled)
        file.flush()

    def _show_line(self, region: _Region, line: _Line, text: str) -> None:
        if line.slot is not None and text == line.shown:
            return
        line.shown = text
        self._settle_clear(region)
        line.slot = self._put(region, line.slot, {"text/plain": f"[rank {region.rank}] {text}"})

    def _put(
        self,
        region: _Region,
        slot: int | None,
        data: dict[str, Any],
        metadata: dict[str, Any] | None = None,
    ) -> int:
        """Show ``data`` in the rank's ``slot`` (None: its next free one); returns the slot."""
        update = slot is not None
        if slot is None:
            slot, reused = region.take_slot()
            update = reused
        display_id = region.slots[slot]
        publish_display_data(data, metadata or {}, transient={"display_id": display_id},
                             update=update)  # fmt: skip
        return slot

    def _settle_clear(self, region: _Region) -> None:
        if region.clear_pending:
            self._clear(region)

    def _clear(self, region: _Region) -> None:
        """Empty the rank's slots: its displays, its growing lines and its region's text."""
        region.clear_pending = False
        region.text_in_region = True
        if not self._slots:
            return
        cleared = set(region.slots[: region.used])
        for display_id in cleared:
            publish_display_data(EMPTY, {}, transient={"display_id": display_id}, update=True)
        region.used = 0
        region.text, region.text_slot = "", None
        for line in region.lines.values():
            line.slot = None
        for key, ids in list(_display_ids.items()):
            if key[0] == region.rank and cleared.intersection(ids):
                _display_ids[key] = [i for i in ids if i not in cleared]


def _remember(rank: int, their_id: str, display_id: str) -> None:
    ids = _display_ids.setdefault((rank, their_id), [])
    ids.append(display_id)
    _display_ids.move_to_end((rank, their_id))
    while len(_display_ids) > KEPT_IDS:
        _display_ids.popitem(last=False)


def _labelled(rank: int, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``[rank N]`` before its text and a ``rank N`` caption above its HTML."""
    data = dict(data)
    if isinstance(data.get("text/plain"), str):
        data["text/plain"] = f"[rank {rank}] {data['text/plain']}"
    if isinstance(data.get("text/html"), str):
        caption = f'<div class="axon-rank" style="font-size:smaller;opacity:0.7">rank {rank}</div>'
        data["text/html"] = caption + data["text/html"]
    return data


def _last_of(line: str) -> str:
    """What a line shows after its carriage returns (``"10%\\r20%"`` shows ``"20%"``)."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]


def _text(part: ipp.AsyncResult, name: str) -> str:
    text = getattr(part, name) or ""
    return "".join(text) if isinstance(text, list) else text
