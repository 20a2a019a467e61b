"""Charts as standalone inline SVG, no plotting library: the one chart code of lgt's pages.

The store's report (``lgt.store.report``) is made where only the proxy's light dependencies are
installed, and the trainer's run pictures (``lgt.trainer.report.plots``) draw with the same code. Every
chart has a frame: a title (unless it is given none: a page heading names it), a light grid, tick
labels, named axes and, for a line chart, an optional second scale along its top edge.

- :func:`line_chart`: lines and markers of :class:`Series` over a numeric x axis, dashed reference
  lines, a legend when more than one series has points.
- :func:`histogram`: bars between bin edges, labelled at the boundaries.
- :func:`category_chart`: one bar per named category, its count above it.
- :func:`axis`: round ticks for a span, for whoever places its own scale.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

FONT = "system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif"
GRID, AXIS, INK, MUTED = "#e6e6e6", "#888", "#222", "#666"
HALO = ' stroke="#fff" stroke-width="4" stroke-linejoin="round"'  # under a label that sits on the lines
WIDE, NARROW = (780, 250), (560, 190)  # (width, plot-area height) of a wide chart and of the others
LEFT, RIGHT, BOTTOM = 64.0, 20.0, 44.0  # margins of the plot area (the top one depends on what is above)

Box = tuple[float, float, float, float]  # the plot area's pixels: x0, y0 (top), x1, y1 (bottom)
Ticks = list[tuple[float, str]]  # (pixel, label)


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]  # finite (x, y) pairs, in drawing order
    color: str
    width: float = 2.0  # line width (0: no line)
    opacity: float = 1.0
    marker: float = 0.0  # marker radius (0: no markers)
    dash: str = ""


def esc(text: Any) -> str:
    return html.escape(str(text))


def fmt(v: float) -> str:
    return f"{v + 0.0:g}"  # + 0.0: no "-0"


def axis(lo: float, hi: float, n: int = 5, *, integer: bool = False,
         expand: bool = True) -> tuple[float, float, list[float]]:
    """(lo, hi, ticks) of an axis showing [lo, hi] with about ``n`` round ticks. An empty span is
    widened (not below 0 when the values are not negative); ``expand`` rounds the ends out to ticks."""
    if hi - lo < 1e-9:
        pad = 1.0 if integer else (abs(lo) * 0.1 or 0.5)
        lo, hi = (lo - pad if lo < 0 or lo - pad >= 0 else 0.0), hi + pad
    raw = (hi - lo) / n
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in ((1, 2, 5, 10) if integer else (1, 2, 2.5, 5, 10)) if m * mag >= raw * 0.999)
    step = max(step, 1.0) if integer else step
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    if expand:
        first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
        lo, hi = round(first * step, 10), round(last * step, 10)
    return lo, hi, [round(i * step, 10) for i in range(first, last + 1)]


def _top(title: str, scale: bool) -> float:
    return (40.0 if title else 16.0) + (24.0 if scale else 0.0)


def frame(size: tuple[int, int], box: Box, title: str, x_label: str, y_label: str, x_ticks: Ticks,
          y_ticks: Ticks, top_ticks: Ticks | None = None, top_label: str = "", *,
          x_grid: bool = True) -> list[str]:
    """The opening ``<svg>``, title, grid, axes, tick labels and axis names (pixel positions given);
    ``x_grid``: vertical grid lines at the x ticks (not for bars labelled at their middles)."""
    w, h = size
    x0, y0, x1, y1 = box
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
             f'role="img" font-family="{FONT}" font-size="11" fill="{INK}">']
    if title:
        parts.append(f"<title>{esc(title)}</title>")
    parts.append(f'<rect width="{w}" height="{h}" fill="#fff"/>')
    if title:
        parts.append(f'<text x="{w / 2:.1f}" y="20" font-size="15" font-weight="600" text-anchor="middle">'
                     f"{esc(title)}</text>")
    for px, label in x_ticks:
        if x_grid:
            parts.append(f'<line x1="{px:.1f}" y1="{y0}" x2="{px:.1f}" y2="{y1}" stroke="{GRID}"/>')
        parts.append(f'<text x="{px:.1f}" y="{y1 + 15}" text-anchor="middle" fill="{MUTED}">'
                     f"{esc(label)}</text>")
    for py, label in y_ticks:
        parts.append(f'<line x1="{x0}" y1="{py:.1f}" x2="{x1}" y2="{py:.1f}" stroke="{GRID}"/>'
                     f'<text x="{x0 - 6}" y="{py + 4:.1f}" text-anchor="end" fill="{MUTED}">'
                     f"{esc(label)}</text>")
    parts.append(f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}" fill="none" '
                 f'stroke="{AXIS}"/>')
    for px, label in top_ticks or []:
        parts.append(f'<line x1="{px:.1f}" y1="{y0 - 4}" x2="{px:.1f}" y2="{y0}" stroke="{AXIS}"/>'
                     f'<text x="{px:.1f}" y="{y0 - 7}" text-anchor="middle" fill="{MUTED}">'
                     f"{esc(label)}</text>")
    if top_label:
        parts.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y0 - 22}" text-anchor="middle" fill="{MUTED}">'
                     f"{esc(top_label)}</text>")
    parts.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y1 + 33}" text-anchor="middle">{esc(x_label)}</text>'
                 f'<text transform="rotate(-90)" x="{-(y0 + y1) / 2:.1f}" y="16" text-anchor="middle">'
                 f"{esc(y_label)}</text>")
    return parts


def empty_note(box: Box, text: str) -> str:
    """An italic note in the middle of an empty plot area."""
    x0, y0, x1, y1 = box
    return (f'<text x="{(x0 + x1) / 2:.1f}" y="{(y0 + y1) / 2:.1f}" text-anchor="middle" fill="#999" '
            f'font-style="italic">{esc(text)}</text>')


def legend_rows(names: list[str], width: float, left: float) -> list[list[tuple[float, int]]]:
    """Legend entries (x, index) laid out in rows that fit ``width``."""
    rows: list[list[tuple[float, int]]] = [[]]
    x = left
    for i, name in enumerate(names):
        span = 30 + 6.2 * len(name) + 18
        if rows[-1] and x + span > width:
            rows.append([])
            x = left
        rows[-1].append((x, i))
        x += span
    return rows if names else []


def line_chart(title: str, series: list[Series], *, x_label: str, y_label: str, x_name: str = "",
               top_ticks: Callable[[float, float], list[tuple[float, str]]] | None = None,
               top_label: str = "", hlines: Sequence[tuple[float, str]] = (), include_y: Sequence[float] = (),
               size: tuple[int, int] = NARROW, integer_y: bool = False,
               empty: str = "nothing to show yet") -> str:
    """Lines (and markers) of ``series`` over an integer x axis. ``x_name``: the x value's name in a
    point's hover text (default ``x_label``); ``top_ticks(x_lo, x_hi)``: (x, label) of a second scale
    along the top edge, named ``top_label``; ``hlines``: dashed horizontal lines (y, label);
    ``include_y``: values the y axis shows whatever the data; a legend when more than one series has
    points; ``empty``: the note shown when none has."""
    w, plot_h = size
    shown = [s for s in series if s.points]
    left, right, top = LEFT, w - RIGHT, _top(title, top_ticks is not None)
    legend = legend_rows([s.name for s in shown], right, left) if len(shown) > 1 else []
    h = int(top + plot_h + BOTTOM + 18 * len(legend))
    box = (left, top, right, top + plot_h)
    xs = [x for s in shown for x, _ in s.points]
    ys = [y for s in shown for _, y in s.points] + [y for y, _ in hlines] + list(include_y)
    x_lo, x_hi, x_ticks = axis(min(xs, default=0.0), max(xs, default=1.0), 8, integer=True, expand=False)
    y_lo, y_hi, y_ticks = axis(min(ys, default=0.0), max(ys, default=1.0), integer=integer_y)
    x_name = x_name or x_label

    def px(x: float) -> float:
        return left + (right - left) * (x - x_lo) / (x_hi - x_lo)

    def py(y: float) -> float:
        return top + plot_h - plot_h * (y - y_lo) / (y_hi - y_lo)

    kept: list[tuple[float, str]] = []
    for t in [] if top_ticks is None else [(px(x), label) for x, label in top_ticks(x_lo, x_hi)]:
        if not kept or t[0] - kept[-1][0] >= 28:  # round values that land close would overprint each other
            kept.append(t)
    parts = frame((w, h), box, title, x_label, y_label, [(px(x), fmt(x)) for x in x_ticks],
                  [(py(y), fmt(y)) for y in y_ticks], kept if top_ticks is not None else None, top_label)
    if not shown:
        parts.append(empty_note(box, empty))
    for s in shown:
        style = f'stroke="{s.color}" stroke-opacity="{s.opacity:g}"'
        if s.width and len(s.points) > 1:
            dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
            pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
            parts.append(f'<polyline points="{pts}" fill="none" {style} stroke-width="{s.width:g}" '
                         f'stroke-linejoin="round"{dash}/>')
        radius = s.marker or (2.5 if len(s.points) == 1 else 0)  # a lone point still shows
        for x, y in s.points if radius else []:
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="{radius:g}" fill="{s.color}" '
                         f'fill-opacity="{s.opacity:g}"><title>{esc(s.name)}, {esc(x_name)} {fmt(x)}: '
                         f"{y:.3f}</title></circle>")
    for y, label in hlines:  # over the data: the label stays readable
        parts.append(f'<line x1="{left}" y1="{py(y):.1f}" x2="{right}" y2="{py(y):.1f}" stroke="#333" '
                     f'stroke-width="1.5" stroke-dasharray="7 4"/>'
                     + "".join(f'<text x="{left + 6}" y="{py(y) - 5:.1f}" font-weight="600"{halo}>'
                               f"{esc(label)}</text>" for halo in (HALO, "")))
    for row_i, row in enumerate(legend):
        ly = top + plot_h + 52 + 18 * row_i
        for x, i in row:
            s = shown[i]
            dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
            parts.append(f'<line x1="{x}" y1="{ly - 4}" x2="{x + 24}" y2="{ly - 4}" stroke="{s.color}" '
                         f'stroke-width="{max(s.width, 1.5):g}"{dash}/>')
            if s.marker:
                parts.append(f'<circle cx="{x + 12}" cy="{ly - 4}" r="{s.marker:g}" fill="{s.color}"/>')
            parts.append(f'<text x="{x + 30}" y="{ly}">{esc(s.name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def bar_chart(title: str, values: list[float], *, x_label: str, y_label: str,
              x_ticks: list[tuple[float, str]], tips: list[str], color: str = "#4c78a8",
              size: tuple[int, int] = NARROW, empty: str = "nothing recorded yet",
              max_bar: float | None = None, value_labels: bool = False, x_grid: bool = True) -> str:
    """Bars side by side from 0 up to ``values``, bar ``i`` spanning x ``i``..``i + 1``: ``x_ticks``
    (x, label) in those units, ``tips`` the bars' hover texts; bars at most ``max_bar`` pixels wide;
    ``value_labels``: each bar's value above it."""
    w, plot_h = size
    left, right, top = LEFT, w - RIGHT, _top(title, False)
    box = (left, top, right, top + plot_h)
    y_lo, y_hi, y_ticks = axis(0.0, max(values, default=1.0), integer=True)
    bw = (right - left) / max(len(values), 1)
    bw = min(bw, max_bar) if max_bar else bw

    def py(y: float) -> float:
        return top + plot_h - plot_h * (y - y_lo) / (y_hi - y_lo)

    parts = frame((w, int(top + plot_h + BOTTOM)), box, title, x_label, y_label,
                  [(left + x * bw, label) for x, label in x_ticks], [(py(y), fmt(y)) for y in y_ticks],
                  x_grid=x_grid)
    if not values:
        parts.append(empty_note(box, empty))
    for i, (v, tip) in enumerate(zip(values, tips)):
        parts.append(f'<rect x="{left + i * bw + 1:.1f}" y="{py(v):.1f}" width="{max(bw - 2, 1):.1f}" '
                     f'height="{py(0) - py(v):.1f}" fill="{color}"><title>{esc(tip)}</title></rect>')
        if value_labels:
            parts.append(f'<text x="{left + (i + 0.5) * bw:.1f}" y="{py(v) - 3:.1f}" font-size="10" '
                         f'text-anchor="middle">{v:g}</text>')
    parts.append("</svg>")
    return "".join(parts)


def histogram(title: str, edges: list[float], counts: list[float], *, x_label: str, y_label: str,
              unit: str = "", color: str = "#4c78a8", size: tuple[int, int] = NARROW,
              empty: str = "nothing recorded yet") -> str:
    """Bars side by side, ``edges`` (one more than ``counts``) labelled at the bars' boundaries."""
    bw = (size[0] - LEFT - RIGHT) / max(len(counts), 1)
    every = max(1, math.ceil(34 / bw))  # label every boundary that has room
    ticks = [(float(i), f"{e:.2g}{unit}") for i, e in enumerate(edges) if counts and i % every == 0]
    tips = [f"{edges[i]:.2g}–{edges[min(i + 1, len(edges) - 1)]:.2g}{unit}: {c:g}"
            for i, c in enumerate(counts)]
    return bar_chart(title, counts, x_label=x_label, y_label=y_label, x_ticks=ticks, tips=tips, color=color,
                     size=size, empty=empty)


def category_chart(title: str, labels: list[str], values: list[float], *, x_label: str, y_label: str,
                   color: str = "#4c78a8", size: tuple[int, int] = NARROW,
                   empty: str = "nothing recorded yet", max_bar: float = 60.0, labelled: int = 24) -> str:
    """One bar per category, at most ``max_bar`` pixels wide; up to ``labelled`` bars each carry their
    (shortened) name below and their value above (more would overprint: their hover texts say it)."""
    few = len(values) <= labelled
    ticks = [(i + 0.5, label[:12]) for i, label in enumerate(labels)] if few else []
    return bar_chart(title, values, x_label=x_label, y_label=y_label, x_ticks=ticks,
                     tips=[f"{label}: {v:g}" for label, v in zip(labels, values)], color=color, size=size,
                     empty=empty, max_bar=max_bar, value_labels=few, x_grid=False)
