"""The order of a rank's printed lines and its ``clear_output`` holds however the kernel's
main thread and ipyparallel's IO thread interleave (``cluster/rank_displays.py``). A rank's
messages come on the IO thread; here a stand-in for its result lets the IO thread's next
messages land at the very moment the main thread reads the rank's text, the race that CI
once lost (a line printed after ``clear_output(wait=True)`` showed outside its region)."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import pytest

from axon_nb.cluster import rank_displays


class RacingPart:
    """A rank's result whose ``stdout`` is being read while ``then`` arrives: the first read
    lets the IO thread deliver its messages (``then``) and returns the text as it is after
    them, as a read that comes just after the IO thread's work would."""

    def __init__(self, stdout: str) -> None:
        self.metadata: dict[str, Any] = {"stdout": stdout, "stderr": "", "outputs": []}
        self.future = SimpleNamespace(
            iopub_callbacks=[], output=SimpleNamespace(metadata=self.metadata)
        )
        self._children = [self.future]
        self.then: list[tuple[str, str]] = []  # ("message", kind) or ("text", printed)

    @property
    def stdout(self) -> str:
        for what, value in self.then:
            if what == "message":
                msg = {"header": {"msg_type": value}, "content": {"wait": True}}
                for callback in self.future.iopub_callbacks:
                    callback(msg)
            else:
                self.metadata["stdout"] += value
        self.then = []
        return self.metadata["stdout"]

    @property
    def stderr(self) -> str:
        return ""


@pytest.fixture
def shown(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """What the kernel shows in slots: ``(text, update)``, as a notebook would get it."""
    published: list[tuple[str, bool]] = []
    monkeypatch.setattr(rank_displays, "in_notebook", lambda: True)

    def publish(data: dict[str, Any], metadata: Any, transient: Any = None, update: bool = False):
        published.append((data.get("text/plain", ""), update))

    monkeypatch.setattr(rank_displays, "publish_display_data", publish)
    return published


def _watched(rank: int, printed: str) -> tuple[RacingPart, io.StringIO, Any]:
    """A rank that has printed ``printed``, the cell's stdout, and the live output of both."""
    part, out = RacingPart(printed), io.StringIO()
    return part, out, rank_displays.LiveOutput({rank: part}, out, io.StringIO())


def test_a_line_printed_after_a_clear_shows_in_the_region_whatever_the_timing(
    shown: list[tuple[str, bool]],
) -> None:
    part, out, live = _watched(1, "kept line\n")
    # The IO thread delivers the rank's clear_output(wait=True), then its "tick 0" line,
    # between the main thread's look at the queue and its read of the text.
    part.then = [("message", "clear_output"), ("text", "tick 0\n")]
    live.flush()
    live.finish()
    assert out.getvalue() == "[rank 1] kept line\n"  # before the clear: the cell's stdout
    assert shown == [("[rank 1] tick 0", False)]  # after it: the rank's region


def test_a_loop_of_clear_and_print_rewrites_one_slot_under_the_same_race(
    shown: list[tuple[str, bool]],
) -> None:
    part, out, live = _watched(0, "")
    for tick in range(3):
        part.then = [("message", "clear_output"), ("text", f"tick {tick}\n")]
        live.flush()
    live.finish()
    assert out.getvalue() == ""
    # one slot, rewritten: tick 0 shown, then emptied and refilled by each later tick
    assert [text for text, _ in shown if text] == ["[rank 0] tick 0", "[rank 0] tick 1",
                                                   "[rank 0] tick 2"]  # fmt: skip


def test_a_read_older_than_the_lines_already_shown_shows_nothing(
    shown: list[tuple[str, bool]],
) -> None:
    """A progress line rewritten (``\\r``) and ended after the text was read: ipyparallel keeps
    only the rewritten line, so the older read is longer than what was shown from the newer
    one. Read past what was shown, it would print a fragment of the old line."""
    _, out, live = _watched(0, "")
    region = live._regions[0]
    live._on_text(region, "stdout", "done\n")  # (a message's lines, from the newer text)
    live._on_text(region, "stdout", "progress 10/10 long", final=True)  # (the older read)
    assert out.getvalue() == "[rank 0] done\n" and shown == []
