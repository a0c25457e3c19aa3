"""``cluster.bandwidth()`` and ``%axon_bench``: nccl-tests-style figures, shown and kept.

The ranks time each collective (``axon_nb.rank.observe.collective_timing``); the kernel keeps the
results on the cluster (``cluster.bandwidth_results``) and
shows them as a table with a plot of bus bandwidth against size.

Example::

    report = cluster.bandwidth(["all_reduce"], sizes="1K:64M")
    report.busbw("all_reduce", 2**26)   # bytes/s at 64 MiB
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from axon_nb.rank import entry
from axon_nb.tables import html_table, text_table

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
               "send_recv")  # fmt: skip
"""What can be measured (the same names as ``axon_nb.rank.observe.collective_timing``)."""
MIN_BYTES, MAX_BYTES = 4, 2**33
UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_sizes(spec: str | Sequence[int]) -> list[int]:
    """Message sizes in bytes: a list, or ``"1K:256M"`` (doubling from the first to the last,
    as nccl-tests' ``-b 1K -e 256M -f 2``); raises ``ValueError`` with the allowed range.

    Example::

        parse_sizes("1K:8K")   # [1024, 2048, 4096, 8192]
    """
    if isinstance(spec, str):
        bounds = spec.split(":")
        if len(bounds) != 2:
            raise ValueError(f"sizes must look like 1K:256M (first:last, doubling), got {spec!r}")
        first, last = (_bytes(b) for b in bounds)
        if first > last:
            raise ValueError(f"sizes {spec!r}: the first size is larger than the last")
        sizes = []
        while first <= last:
            sizes.append(first)
            first *= 2
    else:
        sizes = [int(s) for s in spec]
    bad = [s for s in sizes if not MIN_BYTES <= s <= MAX_BYTES]
    if bad or not sizes:
        raise ValueError(
            f"sizes must be between {MIN_BYTES} bytes and 8G, got {bad or 'none'}; e.g. 1K:256M"
        )
    return sizes


def _bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text.upper())
    if not match:
        raise ValueError(f"cannot read size {text!r}: use e.g. 4096, 1K, 64M or 1G")
    return int(match.group(1)) * UNITS[match.group(2)]


def check_collectives(names: Sequence[str] | str | None) -> list[str]:
    """The collectives asked for (``None`` or ``"all"``: every one); ``ValueError`` names the
    unknown ones."""
    if names is None or names == "all":
        return list(COLLECTIVES)
    names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in COLLECTIVES]
    if unknown:
        raise ValueError(f"unknown collective(s) {unknown}: use {', '.join(COLLECTIVES)} or 'all'")
    return names


@dataclass
class BandwidthReport:
    """Rows of ``collective, axis, ranks, bytes, time_s, algbw, busbw`` (bytes/s); a table in
    the notebook (with a plot) and as text."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def busbw(self, collective: str, size: int, axis: str = "world") -> float:
        """Bus bandwidth (bytes/s) of ``collective`` at the measured size nearest ``size``."""
        rows = [r for r in self.rows if r["collective"] == collective and r["axis"] == axis]
        if not rows:
            raise KeyError(f"{collective} over {axis} was not measured")
        return min(rows, key=lambda r: abs(r["bytes"] - size))["busbw"]

    def __str__(self) -> str:
        return text_table(HEAD, [_cells(r) for r in self.rows], right=True)

    def _repr_html_(self) -> str:
        return f"<div>{self._svg()}{html_table(HEAD, [_cells(r) for r in self.rows])}</div>"

    def plot(self, path: Any = None) -> Any:
        """A matplotlib figure of bus bandwidth against size, one line per collective and axis
        (PNG at ``path``)."""
        import matplotlib.pyplot as plt

        figure, ax = plt.subplots(figsize=(6, 3.5))
        for key, rows in self._series().items():
            ax.plot([r["bytes"] for r in rows], [r["busbw"] / 1e9 for r in rows], marker="o",
                    label=" ".join(key))  # fmt: skip
        ax.set(xscale="log", xlabel="bytes", ylabel="bus bandwidth (GB/s)")
        ax.legend(fontsize=8)
        figure.tight_layout()
        if path is not None:
            figure.savefig(path)
        plt.close(figure)
        return figure

    def _series(self) -> dict[tuple[str, str], list[dict[str, Any]]]:
        series: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in self.rows:
            series.setdefault((r["collective"], r["axis"]), []).append(r)
        return series

    def _svg(self) -> str:
        """A small inline chart (log size against bus bandwidth), so the table needs no
        matplotlib to render."""
        import math

        series = self._series()
        if not series:
            return ""
        top = max(r["busbw"] for r in self.rows) or 1.0
        sizes = [r["bytes"] for r in self.rows]
        lo, hi = math.log2(min(sizes)), max(math.log2(max(sizes)), math.log2(min(sizes)) + 1)
        colors = ["#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363", "#d6616b"]
        lines = []
        for i, (key, rows) in enumerate(series.items()):
            points = " ".join(
                f"{10 + 380 * (math.log2(r['bytes']) - lo) / (hi - lo):.1f},"
                f"{150 - 140 * r['busbw'] / top:.1f}"
                for r in rows
            )
            color = colors[i % len(colors)]
            lines.append(f"<polyline fill='none' stroke='{color}' points='{points}'/>"
                         f"<text x='300' y='{14 + 12 * i}' font-size='10' fill='{color}'>"
                         f"{html.escape(' '.join(key))}</text>")  # fmt: skip
        return (f"<svg width='400' height='160' style='border:1px solid #ddd'>{''.join(lines)}"
                f"<text x='4' y='10' font-size='9'>{_rate(top)}</text></svg>")  # fmt: skip


HEAD = ("collective", "axis", "ranks", "size", "time", "algbw", "busbw")


def _cells(r: dict[str, Any]) -> tuple[str, ...]:
    return (r["collective"], r["axis"], str(r["ranks"]), _size(r["bytes"]),
            f"{r['time_s'] * 1e6:,.1f} us", _rate(r["algbw"]), _rate(r["busbw"]))  # fmt: skip


def _size(n: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def _rate(bps: float) -> str:
    return f"{bps / 1e9:,.2f} GB/s"


def axes(ranks: list[dict[str, Any]]) -> list[str]:
    """``world``, and with several hosts also ``intra_host`` and ``inter_host``."""
    hosts = {r["host"] for r in ranks}
    if len(hosts) > 1 and len(ranks) > len(hosts):
        return ["world", "intra_host", "inter_host"]
    return ["world"]


def bandwidth(
    cluster: Any,
    collectives: Sequence[str] | str | None = None,
    sizes: str | Sequence[int] = "1K:16M",
    *,
    iters: int = 10,
    warmup: int = 3,
) -> BandwidthReport:
    """Time each collective at each size on the live ranks (over the world, and with several
    hosts also within and across hosts); kept as ``cluster.bandwidth_results``.

    Example::

        cluster.bandwidth()                                   # every collective, 1K..16M
        cluster.bandwidth("all_reduce", sizes="1M:256M", iters=20)
    """
    names = check_collectives(collectives)
    byte_sizes = parse_sizes(sizes)
    for name, value, least in (("iters", iters, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    rows: list[dict[str, Any]] = []
    for axis in axes(cluster.ranks):
        rows += cluster.run(
            entry.measure_collectives,
            names,
            byte_sizes,
            iters=iters,
            warmup=warmup,
            axis=axis,
            stream=False,
        )[0]
    cluster.bandwidth_results = BandwidthReport(rows)
    return cluster.bandwidth_results
