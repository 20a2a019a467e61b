"""A run's pictures: SVG files in ``<run>/plots/`` and one page, ``<run>/report.html``, that shows them.

Inline SVG only (no plotting library), every chart with a title, named axes, tick labels and a light
grid; charts over training steps also carry the minutes since training started along their top edge.
Drawn: the reward (raw per-step training reward, its 10-step trailing mean, the held-out eval rewards
and the target), the rollout duration distribution, staleness per step and drain seconds per step.
The page puts the run's summary (``summary.py``) on top, the charts below it and links the store's
own report (``lgt-train report``) when there is one.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lgt.trainer.report import summary as run_summary
from lgt.trainer.report.summary import number, read_jsonl, trailing_means

FONT = "system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif"
GRID, AXIS, INK, MUTED = "#e6e6e6", "#888", "#222", "#666"
HALO = ' stroke="#fff" stroke-width="4" stroke-linejoin="round"'  # under a label that sits on the lines
WIDE, NARROW = (780, 250), (560, 190)  # (width, plot-area height) of the reward chart and the others


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]  # finite (x, y) pairs, in drawing order
    color: str
    width: float = 2.0  # line width (0: no line)
    opacity: float = 1.0
    marker: float = 0.0  # marker radius (0: no markers)
    dash: str = ""


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _esc(text: Any) -> str:
    return html.escape(str(text))


def _fmt(v: float) -> str:
    return f"{v + 0.0:g}"  # + 0.0: no "-0"


def points(xs: Sequence[Any], ys: Sequence[Any]) -> list[tuple[float, float]]:
    """The (x, y) pairs where both are finite numbers (None, NaN and missing values are skipped)."""
    return [(x, y) for x, y in ((number(a), number(b)) for a, b in zip(xs, ys))
            if x is not None and y is not None]


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


def _frame(size: tuple[int, int], box: tuple[float, float, float, float], title: str, x_label: str,
           y_label: str, x_ticks: list[tuple[float, str]], y_ticks: list[tuple[float, str]],
           top_ticks: list[tuple[float, str]] | None = None, top_label: str = "") -> list[str]:
    """The opening ``<svg>``, title, grid, axes, tick labels and axis names (pixel positions given)."""
    w, h = size
    x0, y0, x1, y1 = box
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
             f'role="img" font-family="{FONT}" font-size="11" fill="{INK}">',
             f"<title>{_esc(title)}</title>", f'<rect width="{w}" height="{h}" fill="#fff"/>',
             f'<text x="{w / 2:.1f}" y="20" font-size="15" font-weight="600" text-anchor="middle">'
             f"{_esc(title)}</text>"]
    for px, label in x_ticks:
        parts.append(f'<line x1="{px:.1f}" y1="{y0}" x2="{px:.1f}" y2="{y1}" stroke="{GRID}"/>'
                     f'<text x="{px:.1f}" y="{y1 + 15}" text-anchor="middle" fill="{MUTED}">'
                     f"{_esc(label)}</text>")
    for py, label in y_ticks:
        parts.append(f'<line x1="{x0}" y1="{py:.1f}" x2="{x1}" y2="{py:.1f}" stroke="{GRID}"/>'
                     f'<text x="{x0 - 6}" y="{py + 4:.1f}" text-anchor="end" fill="{MUTED}">'
                     f"{_esc(label)}</text>")
    parts.append(f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}" fill="none" '
                 f'stroke="{AXIS}"/>')
    for px, label in top_ticks or []:
        parts.append(f'<line x1="{px:.1f}" y1="{y0 - 4}" x2="{px:.1f}" y2="{y0}" stroke="{AXIS}"/>'
                     f'<text x="{px:.1f}" y="{y0 - 7}" text-anchor="middle" fill="{MUTED}">'
                     f"{_esc(label)}</text>")
    if top_label:
        parts.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y0 - 22}" text-anchor="middle" fill="{MUTED}">'
                     f"{_esc(top_label)}</text>")
    parts.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y1 + 33}" text-anchor="middle">{_esc(x_label)}</text>'
                 f'<text transform="rotate(-90)" x="{-(y0 + y1) / 2:.1f}" y="16" text-anchor="middle">'
                 f"{_esc(y_label)}</text>")
    return parts


def _empty(box: tuple[float, float, float, float], text: str) -> str:
    x0, y0, x1, y1 = box
    return (f'<text x="{(x0 + x1) / 2:.1f}" y="{(y0 + y1) / 2:.1f}" text-anchor="middle" fill="#999" '
            f'font-style="italic">{_esc(text)}</text>')


def _legend_rows(names: list[str], width: float, left: float) -> list[list[tuple[float, int]]]:
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


def minute_ticks(anchors: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, str]]:
    """(step, label) of round minutes along the steps ``lo``..``hi``, placed by interpolating the
    (step, seconds) anchors; training started at step 0, second 0."""
    pts = [(0.0, 0.0)]
    for s, t in sorted(anchors):
        if s > pts[-1][0] and t > pts[-1][1]:
            pts.append((s, t))
    if len(pts) < 2:
        return []
    _, _, ticks = axis(0.0, pts[-1][1] / 60, 6, expand=False)
    out = []
    for m in ticks:
        sec = m * 60
        for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
            if t0 <= sec <= t1:
                x = s0 + (s1 - s0) * (sec - t0) / (t1 - t0)
                if lo - 1e-9 <= x <= hi + 1e-9:
                    out.append((x, _fmt(m)))
                break
    return out


def line_chart(title: str, series: list[Series], *, y_label: str, x_label: str = "training step",
               minutes: list[tuple[float, float]] | None = None, hlines: Sequence[tuple[float, str]] = (),
               include_y: Sequence[float] = (), size: tuple[int, int] = NARROW,
               integer_y: bool = False, empty: str = "no steps yet") -> str:
    """A line chart over training steps; ``minutes``: (step, seconds) pairs for the top minute scale;
    ``hlines``: dashed horizontal lines (y, label); a legend when more than one series has points."""
    w, plot_h = size
    shown = [s for s in series if s.points]
    left, right, top = 64.0, w - 20.0, 64.0 if minutes is not None else 40.0
    legend = _legend_rows([s.name for s in shown], right, left) if len(shown) > 1 else []
    h = int(top + plot_h + 44 + 18 * len(legend))
    box = (left, top, right, top + plot_h)
    xs = [x for s in shown for x, _ in s.points]
    ys = [y for s in shown for _, y in s.points] + [y for y, _ in hlines] + list(include_y)
    x_lo, x_hi, x_ticks = axis(min(xs, default=0.0), max(xs, default=1.0), 8, integer=True, expand=False)
    y_lo, y_hi, y_ticks = axis(min(ys, default=0.0), max(ys, default=1.0), integer=integer_y)

    def px(x: float) -> float:
        return left + (right - left) * (x - x_lo) / (x_hi - x_lo)

    def py(y: float) -> float:
        return top + plot_h - plot_h * (y - y_lo) / (y_hi - y_lo)

    tops = None if minutes is None else [(px(x), label) for x, label in minute_ticks(minutes, x_lo, x_hi)]
    kept: list[tuple[float, str]] = []
    for t in tops or []:  # rounds minutes that land on a few steps would overprint each other
        if not kept or t[0] - kept[-1][0] >= 28:
            kept.append(t)
    parts = _frame((w, h), box, title, x_label, y_label, [(px(x), _fmt(x)) for x in x_ticks],
                   [(py(y), _fmt(y)) for y in y_ticks], kept if minutes is not None else None,
                   "minutes since training started" if minutes is not None else "")
    if not shown:
        parts.append(_empty(box, empty))
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
                         f'fill-opacity="{s.opacity:g}"><title>{_esc(s.name)}, step {_fmt(x)}: {y:.3f}'
                         "</title></circle>")
    for y, label in hlines:  # over the data: the label stays readable
        parts.append(f'<line x1="{left}" y1="{py(y):.1f}" x2="{right}" y2="{py(y):.1f}" stroke="#333" '
                     f'stroke-width="1.5" stroke-dasharray="7 4"/>'
                     + "".join(f'<text x="{left + 6}" y="{py(y) - 5:.1f}" font-weight="600"{halo}>'
                               f"{_esc(label)}</text>" for halo in (HALO, "")))
    for row_i, row in enumerate(legend):
        ly = top + plot_h + 52 + 18 * row_i
        for x, i in row:
            s = shown[i]
            dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
            parts.append(f'<line x1="{x}" y1="{ly - 4}" x2="{x + 24}" y2="{ly - 4}" stroke="{s.color}" '
                         f'stroke-width="{max(s.width, 1.5):g}"{dash}/>')
            if s.marker:
                parts.append(f'<circle cx="{x + 12}" cy="{ly - 4}" r="{s.marker:g}" fill="{s.color}"/>')
            parts.append(f'<text x="{x + 30}" y="{ly}">{_esc(s.name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def bar_chart(title: str, edges: list[float], counts: list[float], *, x_label: str, y_label: str,
              color: str = "#4c78a8", unit: str = "", size: tuple[int, int] = NARROW,
              empty: str = "nothing recorded yet") -> str:
    """Bars side by side, ``edges`` (one more than ``counts``) labelled at the bars' boundaries."""
    w, plot_h = size
    left, right, top = 64.0, w - 20.0, 40.0
    box = (left, top, right, top + plot_h)
    y_lo, y_hi, y_ticks = axis(0.0, max(counts, default=1.0), integer=True)
    bw = (right - left) / max(len(counts), 1)

    def py(y: float) -> float:
        return top + plot_h - plot_h * (y - y_lo) / (y_hi - y_lo)

    every = max(1, math.ceil(34 / bw))  # label every boundary that has room
    x_ticks = [(left + i * bw, f"{e:.2g}{unit}") for i, e in enumerate(edges) if counts and i % every == 0]
    parts = _frame((w, int(top + plot_h + 44)), box, title, x_label, y_label, x_ticks,
                   [(py(y), _fmt(y)) for y in y_ticks])
    if not counts:
        parts.append(_empty(box, empty))
    for i, c in enumerate(counts):
        lo, hi = edges[i], edges[min(i + 1, len(edges) - 1)]
        parts.append(f'<rect x="{left + i * bw + 1:.1f}" y="{py(c):.1f}" width="{max(bw - 2, 1):.1f}" '
                     f'height="{py(0) - py(c):.1f}" fill="{color}"><title>{lo:.2g}–{hi:.2g}{unit}: '
                     f"{c:g}</title></rect>")
    parts.append("</svg>")
    return "".join(parts)


def duration_histogram(seconds: list[float], bins: int = 12) -> tuple[list[float], list[float]]:
    """Bin edges (one more than the counts) and counts of rollout durations, log-spaced: the tail is
    the point. Durations that are not finite numbers are left out."""
    seconds = [s for s in (number(v) for v in seconds) if s is not None]
    if not seconds:
        return [], []
    lo, hi = max(min(seconds), 1e-3), max(seconds)
    if hi <= lo * 1.0001:
        return [lo, hi], [float(len(seconds))]
    edges = [lo * (hi / lo) ** (i / bins) for i in range(bins + 1)]
    counts = [0.0] * bins
    for s in seconds:
        i = min(int(bins * math.log(max(s, lo) / lo) / math.log(hi / lo)), bins - 1)
        counts[i] += 1
    return edges, counts


def reward_chart(rows: list[dict[str, Any]], evals: list[dict[str, Any]] | None = None,
                 target: float | None = None, minutes: list[tuple[float, float]] | None = None) -> str:
    """Training reward per step (faint), its 10-step trailing mean (bold), held-out eval rewards
    (markers, step 0 = before the first update) and the target (dashed)."""
    evals = evals or []
    steps = [r.get("step") for r in rows]
    raw = [number(r.get("rollout/reward_mean")) for r in rows]
    means = [m for m, _ in trailing_means(raw)]
    e_steps = [e.get("step") for e in evals]
    series = [
        Series("training reward per step", points(steps, raw), "#e45756", width=1, opacity=0.4, marker=1.8),
        Series("training reward, 10-step mean", points(steps, means), "#c1272d", width=2.8),
        Series("held-out eval, greedy", points(e_steps, [e.get("eval/reward_greedy") for e in evals]),
               "#1f5fa8", width=1.5, marker=3.5),
        Series("held-out eval, sampled", points(e_steps, [e.get("eval/reward_sampled") for e in evals]),
               "#2e8b3e", width=1.5, marker=3.5, dash="5 3"),
    ]
    target = number(target)
    return line_chart("Reward per training step", series, y_label="mean reward", minutes=minutes,
                      include_y=(0.0, 1.0), size=WIDE,
                      hlines=[] if target is None else [(target, f"target {target:g}")])


def charts(rows: list[dict[str, Any]], durations: list[float], evals: list[dict[str, Any]] | None = None,
           target: float | None = None) -> dict[str, tuple[str, str]]:
    """name -> (caption, svg), the reward first."""
    steps = [r.get("step") for r in rows]
    minutes = points(steps, [r.get("time_s") for r in rows]) + \
        points([e.get("step") for e in evals or []], [e.get("time_s") for e in evals or []])
    edges, counts = duration_histogram(durations)

    def per_step(title: str, key: str, name: str, y_label: str, color: str, integer: bool = False) -> str:
        return line_chart(title, [Series(name, points(steps, [r.get(key) for r in rows]), color, marker=2)],
                          y_label=y_label, minutes=minutes, include_y=(0.0,), integer_y=integer)

    return {
        "reward": ("Mean reward of the rollouts trained at each step (faint), its trailing 10-step mean "
                   "(bold), the held-out evaluation when there is one (step 0: before the first update) "
                   "and the target.", reward_chart(rows, evals, target, minutes)),
        "rollout_duration": ("Rollout durations (log-spaced bins): the tail that sync mode waits for.",
                             bar_chart("Rollout duration", edges, counts, unit="s", empty="no rollouts yet",
                                       x_label="seconds per rollout (log-spaced bins)", y_label="rollouts")),
        "staleness": ("Policy versions between the oldest trained call and the policy being trained.",
                      per_step("Staleness", "rollout/staleness_max", "oldest trained call",
                               "policy versions behind", "#b279a2", integer=True)),
        "drain_seconds": ("Seconds the proxy took to drain in-flight calls at each update.",
                          per_step("Drain time per update", "perf/drain_s", "drain", "seconds", "#f58518")),
    }


def _summary(run_dir: Path) -> dict[str, Any]:
    """The figures as of now, with the stop reason summary.json recorded (when it did)."""
    stopped = run_summary.read_json(run_dir / "summary.json").get("stopped")
    return run_summary.summarize(run_dir, stopped=stopped if isinstance(stopped, str) else None)


def write_run_report(run_dir: Path, rows: list[dict[str, Any]]) -> Path:
    run_dir = Path(run_dir)
    durations = [r.get("seconds") for r in read_jsonl(run_dir / "rollouts.jsonl")]
    evals = read_jsonl(run_dir / "eval.jsonl")
    summary = _summary(run_dir)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    made = charts(rows, durations, evals, summary["target"])
    for name, (_, svg) in made.items():
        _atomic_write(out / f"{name}.svg", svg + "\n")
    store_link = ('<p><a href="store-report.html">the store\'s report</a> (calls, samples, merge breaks)</p>'
                  if (run_dir / "store-report.html").exists() else "")
    body = "".join(f'<section class="{"wide" if n == "reward" else "chart"}"><p>{html.escape(c)}</p>{s}'
                   "</section>" for n, (c, s) in made.items())
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(run_dir.name)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}}
section{{display:inline-block;vertical-align:top;margin:0 2em 2em 0;width:{NARROW[0]}px}}
section.wide{{display:block;width:{WIDE[0]}px}}
pre.summary{{background:#f6f6f4;border-left:4px solid #c1272d;padding:.8em 1em;font-size:.95em;
overflow-x:auto}}p{{color:#555;font-size:.9em}}</style></head>
<body><h1>{html.escape(run_dir.name)}</h1>
<pre class="summary">{html.escape(run_summary.render(summary))}</pre>
{store_link}{body}</body></html>
"""
    _atomic_write(run_dir / "report.html", page)
    return run_dir / "report.html"
