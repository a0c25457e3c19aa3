"""Result tables as text (aligned columns) and HTML, for the objects that render in the
notebook and print as text (``Comparison``, ``Advice``, ``BandwidthReport``).

Example::

    print(text_table(("name", "size"), [("a", "1"), ("bb", "22")]))
"""

from __future__ import annotations

import html
from collections.abc import Sequence


def text_table(
    head: Sequence[str], rows: Sequence[Sequence[str]], *, right: bool = False,
    ragged_last: bool = False,
) -> str:  # fmt: skip
    """Columns padded to their widest cell (right-aligned with ``right``); with
    ``ragged_last`` the last column is left as is (long free text)."""
    lines = [tuple(head), *(tuple(r) for r in rows)]
    padded = len(head) - 1 if ragged_last else len(head)
    widths = [max(len(line[i]) for line in lines) for i in range(padded)]
    out = []
    for line in lines:
        cells = [c.rjust(w) if right else c.ljust(w) for c, w in zip(line, widths, strict=False)]
        out.append("  ".join([*cells, *line[padded:]]).rstrip())
    return "\n".join(out)


def html_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain ``<table>`` with escaped cells."""
    top = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{top}</tr></thead><tbody>{body}</tbody></table>"
