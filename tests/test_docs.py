"""The documentation's code: every fenced block in README.md and docs/ is run here or marked.

A ```python block runs; the blocks of one page run in order, in one IPython namespace (so
``%load_ext axon_nb``, ``%axon_cluster`` and ``%%axon`` cells run as in a notebook), in a fresh
directory. Any other block, and a python block that cannot run here, carries the line
``<!-- not run: <reason> -->`` right before it (a GPU, other hosts, Slurm, a shell command that
CI runs anyway, a program's output). A page that starts a cluster must stop it.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from IPython.core.interactiveshell import InteractiveShell

import axon_nb
from axon_nb.cluster import warm_engines
from axon_nb.magics import AxonMagics

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 250

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+)(?P<info>[^`\s]*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>\S.*?) -->$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    """The line of its opening fence (1-based)."""
    language: str
    code: str
    not_run: str | None
    """Why it is not run here (the marker's reason), or None."""

    @property
    def runs(self) -> bool:
        return self.not_run is None and self.language == "python"

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a page, each with the marker on the last non-blank line before
    it, if any. Example::

        blocks(Path("x.md"), "<!-- not run: output -->\\n```\\nok\\n```\\n")[0].not_run
        # 'output'
    """
    lines = (page.read_text() if text is None else text).splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), len(lines))
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(before)
        code = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end])
        found.append(
            Block(page, i + 1, opening["info"], code, marker["reason"] if marker else None)
        )
        i = end + 1
    return found


def test_every_block_is_run_or_marked_with_a_reason() -> None:
    unmarked = [
        f"{b.where()}: a ```{b.language or '(no language)'} block is neither run (python) nor "
        "marked <!-- not run: <reason> -->"
        for page in PAGES
        for b in blocks(page)
        if not b.runs and b.not_run is None
    ]
    assert unmarked == []


def test_a_block_with_neither_fails_the_check() -> None:
    text = "```\nmake test\n```\n\n<!-- not run: CI runs it -->\n```\nmake test\n```\n"
    found = blocks(Path("x.md"), text)
    assert [(b.runs, b.not_run) for b in found] == [(False, None), (False, "CI runs it")]
    python = blocks(Path("x.md"), "<!-- not run:  -->\n```python\nx = 1\n```\n")
    assert python[0].runs  # a marker without a reason does not count


def test_the_readme_is_short_and_its_links_into_the_docs_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    links = re.findall(r"\]\(((?:docs/|ARCHITECTURE)[^)#]*)", readme)
    assert links, "the README links into docs/"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert missing == []


RUNNABLE = [page for page in PAGES if any(b.runs for b in blocks(page))]


@pytest.fixture(scope="module")
def warm_between_pages() -> Iterator[None]:
    """Each page starts and stops its own cluster; the kernel's warm process for engines
    (which a stop ends) is kept from one page to the next, so each start forks its engines
    instead of importing torch again. It ends after the last page."""
    stop_if_idle = warm_engines.stop_if_idle
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(warm_engines, "stop_if_idle", lambda: None)
        yield
    stop_if_idle()


@pytest.mark.cluster
@pytest.mark.timeout(240)
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_page_runs(
    page: Path, warm_between_pages: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    shell = InteractiveShell.instance()
    shell.reset(new_session=False)
    try:
        for block in blocks(page):
            if block.runs:
                result = shell.run_cell(textwrap.dedent(block.code), store_history=False)
                if not result.success:
                    error = result.error_in_exec or result.error_before_exec
                    pytest.fail(f"{block.where()} failed: {error!r}")
        running = [
            name
            for name, value in shell.user_ns.items()
            if isinstance(value, axon_nb.Cluster) and value.running
        ]
        magics = AxonMagics.instance
        if magics is not None and magics.cluster is not None and magics.cluster.running:
            running.append("%axon_cluster's")
        assert running == [], f"{page.name} leaves its cluster running: stop it at the end"
    finally:
        if "axon_nb" in shell.extension_manager.loaded:
            shell.extension_manager.unload_extension("axon_nb")  # (stops a magic's cluster)
        for value in list(shell.user_ns.values()):
            if isinstance(value, axon_nb.Cluster):
                value.stop(keep_warm=True)
