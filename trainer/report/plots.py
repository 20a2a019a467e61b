"""A run's pictures: SVG files in ``<run>/plots/`` and one page, ``<run>/report.html``, that shows them.

Inline SVG only, drawn by the store's chart module (``lgt.store.charts``, shared with the store's own
report): every chart with a title, named axes, tick labels and a light grid; charts over training steps
also carry the minutes since training started along their top edge.
Drawn: the reward (raw per-step training reward, its 10-step trailing mean, the held-out eval rewards
and the target), the rollout duration distribution, staleness per step and drain seconds per step.
The page puts the run's summary (``summary.py``) on top, the charts below it and links the store's
own report (``lgt-train report``) when there is one.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lgt.store import charts as chartlib
from lgt.store.charts import NARROW, WIDE, Series, axis, fmt
from lgt.store.files import write_atomic
from lgt.trainer.report import summary as run_summary
from lgt.trainer.report.summary import number, read_jsonl, trailing_means

__all__ = ["Series", "axis", "charts", "duration_histogram", "line_chart", "minute_ticks", "points",
           "reward_chart", "write_run_report"]


def points(xs: Sequence[Any], ys: Sequence[Any]) -> list[tuple[float, float]]:
    """The (x, y) pairs where both are finite numbers (None, NaN and missing values are skipped)."""
    return [(x, y) for x, y in ((number(a), number(b)) for a, b in zip(xs, ys))
            if x is not None and y is not None]


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
                    out.append((x, fmt(m)))
                break
    return out


def line_chart(title: str, series: list[Series], *, y_label: str, x_label: str = "training step",
               minutes: list[tuple[float, float]] | None = None, empty: str = "no steps yet",
               **kw: Any) -> str:
    """A line chart over training steps (:func:`lgt.store.charts.line_chart`, its other keywords);
    ``minutes``: (step, seconds) pairs for the minutes since training started along the top edge."""
    top = None if minutes is None else (lambda lo, hi: minute_ticks(minutes, lo, hi))
    return chartlib.line_chart(title, series, x_label=x_label, y_label=y_label, x_name="step", top_ticks=top,
                               top_label="" if minutes is None else "minutes since training started",
                               empty=empty, **kw)


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
                             chartlib.histogram("Rollout duration", edges, counts, unit="s",
                                                x_label="seconds per rollout (log-spaced bins)",
                                                y_label="rollouts", empty="no rollouts yet")),
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
        write_atomic(out / f"{name}.svg", svg + "\n")
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
    write_atomic(run_dir / "report.html", page)
    return run_dir / "report.html"
