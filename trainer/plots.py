"""A run's pictures: SVG files in ``<run>/plots/`` and one page, ``<run>/report.html``, that shows them.

Inline SVG only (no plotting library): reward per step, rollout duration distribution, staleness per
step, drain seconds per step, and the store's own report (``lgt-train report``) next to them.
"""

from __future__ import annotations

import html
import json
import math
import os
from pathlib import Path
from typing import Any

from lgt.store.report import _svg_bars, _svg_line


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def duration_histogram(seconds: list[float], bins: int = 12) -> tuple[list[str], list[float]]:
    """Bar labels and counts of rollout durations (log-spaced bins: the tail is the point)."""
    if not seconds:
        return [], []
    lo, hi = max(min(seconds), 1e-3), max(seconds)
    if hi <= lo * 1.0001:
        return [f"{lo:.2g}s"], [float(len(seconds))]
    edges = [lo * (hi / lo) ** (i / bins) for i in range(bins + 1)]
    counts = [0.0] * bins
    for s in seconds:
        i = min(int(bins * math.log(max(s, lo) / lo) / math.log(hi / lo)), bins - 1)
        counts[i] += 1
    return [f"{edges[i]:.2g}–{edges[i + 1]:.2g}s" for i in range(bins)], counts


def charts(rows: list[dict[str, Any]], durations: list[float]) -> dict[str, tuple[str, str]]:
    """name -> (caption, svg)."""
    steps = [r["step"] for r in rows]

    def series(key: str) -> list[float]:
        return [float(r.get(key) or 0.0) for r in rows]

    labels, counts = duration_histogram(durations)
    return {
        "reward": ("Mean reward of the rollouts trained at each step.",
                   _svg_line(steps, series("rollout/reward_mean"))),
        "rollout_duration": ("Rollout durations (log-spaced bins): the tail that sync mode waits for.",
                             _svg_bars(labels, counts, "#4c78a8")),
        "staleness": ("Policy versions between the oldest trained call and the policy being trained.",
                      _svg_line(steps, series("rollout/staleness_max"), "#b279a2")),
        "drain_seconds": ("Seconds the proxy took to drain in-flight calls at each update.",
                          _svg_line(steps, series("perf/drain_s"), "#f58518")),
    }


def write_run_report(run_dir: Path, rows: list[dict[str, Any]]) -> Path:
    run_dir = Path(run_dir)
    durations = []
    if (run_dir / "rollouts.jsonl").exists():
        for line in (run_dir / "rollouts.jsonl").read_text().splitlines():
            if line.strip():
                durations.append(float(json.loads(line).get("seconds") or 0.0))
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    made = charts(rows, durations)
    for name, (_, svg) in made.items():
        if svg.startswith("<svg"):
            _atomic_write(out / f"{name}.svg",
                          svg.replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1))
    last = rows[-1] if rows else {}
    summary = (f"{len(rows)} steps · {len(durations)} rollouts · final reward "
               f"{last.get('rollout/reward_mean', float('nan')):.3f} · {last.get('time_s', 0):.0f} s")
    store_link = ('<p><a href="store-report.html">the store\'s report</a> (calls, samples, merge breaks)</p>'
                  if (run_dir / "store-report.html").exists() else "")
    body = "".join(f"<section><h2>{html.escape(n.replace('_', ' '))}</h2><p>{html.escape(c)}</p>{s}"
                   "</section>" for n, (c, s) in made.items())
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(run_dir.name)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}}
section{{display:inline-block;vertical-align:top;margin:0 2em 2em 0;width:560px}}h2{{font-size:1.1em}}
p{{color:#555;font-size:.9em}}.empty{{color:#999;font-style:italic}}</style></head>
<body><h1>{html.escape(run_dir.name)}</h1><p>{html.escape(summary)}</p>{store_link}{body}</body></html>
"""
    _atomic_write(run_dir / "report.html", page)
    return run_dir / "report.html"
