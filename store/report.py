"""``lgt-train report``: one self-contained HTML page about a store, charts as inline SVG.

No plotting library (the page is made where only the proxy's light dependencies are installed; the
charts are :mod:`lgt.store.charts`, which draws the trainer's run pictures too): reward per step,
samples per rollout, merge breaks by reason, policy staleness of calls, the calls' status counts, how
completely their tokens were captured, and what agents reached besides their LLM calls (egress,
blocked or allowed). Every chart is built from one SQL query over the store's
views or from the sample build, so what the page shows is what ``lgt-train sql`` shows.
"""

from __future__ import annotations

import datetime as dt
import html
import os
from typing import Any

import duckdb

from . import charts
from .files import write_atomic

W = 560  # the page's column (and chart) width
SIZE = (W, 150)  # (width, plot-area height) of every chart


def _bars(labels: list[str], values: list[float], color: str, *, x_label: str, y_label: str) -> str:
    return charts.category_chart("", labels, values, x_label=x_label, y_label=y_label, color=color, size=SIZE)


def _table(rows: list[tuple[str, int]]) -> str:
    """Counted sentences, most first: text too long for a bar's label."""
    if not rows:
        return '<p class="empty">nothing recorded yet</p>'
    body = "".join(f"<tr><td class=n>{n}</td><td>{html.escape(text)}</td></tr>" for text, n in rows)
    return f"<table>{body}</table>"


def _rewards(steps: list[tuple[float, float, int]]) -> str:
    series = charts.Series("mean reward", [(x, y) for x, y, _ in steps], "#e45756", marker=2.5)
    return charts.line_chart("", [series], x_label="step", y_label="mean reward", include_y=(0.0, 1.0),
                             size=SIZE, empty="no rewards with a step yet (steps come from the rollouts "
                             "table)")


def report_data(con: duckdb.DuckDBPyConnection, build_report: dict[str, Any] | None = None) -> dict[str, Any]:
    """The numbers behind the page (also what the tests check); ``build_report``: the report of a
    sample build of the store (``lgt.store.samples``), for its samples per rollout and merge breaks."""
    rows = con.execute("""
        SELECT o.step, avg(w.value), count(*)
        FROM rollouts o JOIN rewards w USING (rollout_id, attempt)
        WHERE w.call_id IS NULL AND o.step IS NOT NULL AND o.status = 'ok'
        GROUP BY 1 ORDER BY 1""").fetchall()
    status = con.execute("SELECT status, count(*) FROM calls GROUP BY 1 ORDER BY 2 DESC").fetchall()
    stale = con.execute("""
        SELECT (SELECT max(policy_version) FROM calls) - policy_version AS behind, count(*)
        FROM calls WHERE status = 'ok' GROUP BY 1 ORDER BY 1""").fetchall()
    totals = con.execute("""
        SELECT (SELECT count(*) FROM calls), (SELECT count(*) FROM rollouts),
               (SELECT count(*) FROM rewards WHERE call_id IS NULL),
               (SELECT coalesce(sum(usage_total_tokens), 0) FROM calls)""").fetchall()[0]
    capture: list[tuple[str, int]] = []
    if "capture" in _columns(con, "calls"):  # stores written before schema 3 lack it
        capture = [(str(c), int(n)) for c, n in con.execute("""
            SELECT coalesce(capture || coalesce(' (' || capture_reason || ')', ''), 'not recorded'),
                   count(*)
            FROM calls WHERE status = 'ok' GROUP BY 1 ORDER BY 2 DESC""").fetchall()]
    egress = con.execute("""
        SELECT host, bool_and(allowed), count(*) FROM egress GROUP BY 1 ORDER BY 3 DESC, 1 LIMIT 30"""
                         ).fetchall()
    refused = con.execute("""
        SELECT coalesce(http_status::VARCHAR || ' ', '')
               || regexp_replace(coalesce(error, '?'), '[0-9]+', 'N', 'g'), count(*)
        FROM calls WHERE status = 'rejected' GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT 20""").fetchall()
    approximated: list[tuple[str, int]] = []
    if "translation" in _columns(con, "calls"):  # stores written before schema 6 lack it
        approximated = [(str(k), int(n)) for k, n in con.execute("""
            SELECT regexp_replace(note, '[0-9]+', 'N', 'g'), count(*)
            FROM (SELECT unnest(translation) AS note FROM calls WHERE translation IS NOT NULL)
            GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT 20""").fetchall()]
    data: dict[str, Any] = {
        "refused": [(str(r), int(n)) for r, n in refused],
        "approximated": approximated,
        "capture": capture,
        "egress": [(h, bool(a), int(n)) for h, a, n in egress],
        "reward_per_step": [(float(s), float(v), int(n)) for s, v, n in rows],
        "call_status": [(s, int(n)) for s, n in status],
        "staleness": [(int(b), int(n)) for b, n in stale if b is not None],
        "totals": dict(zip(("calls", "rollouts", "rewarded_rollouts", "tokens"),
                           (int(t) for t in totals))),
        "samples_per_rollout": [],
        "merge_breaks": [],
    }
    if build_report is not None:
        data["samples_per_rollout"] = sorted((int(k), n) for k, n in
                                             build_report.get("samples_per_rollout", {}).items())
        data["merge_breaks"] = sorted(build_report.get("merge_breaks", {}).items(), key=lambda kv: -kv[1])
    return data


def _columns(con: duckdb.DuckDBPyConnection, view: str) -> list[str]:
    return [d[0] for d in con.execute(f"SELECT * FROM {view} LIMIT 0").description]


def render_html(data: dict[str, Any], title: str) -> str:
    t = data["totals"]
    steps = data["reward_per_step"]
    sections = [
        ("Reward per step", "Mean rollout reward of the rollouts of each step (ok rollouts only).",
         _rewards(steps)),
        ("Samples per rollout", "How many training samples each rollout became (1 is ideal: every "
         "call extended the previous one).",
         _bars([str(k) for k, _ in data["samples_per_rollout"]],
               [float(n) for _, n in data["samples_per_rollout"]], "#54a24b", x_label="samples",
               y_label="rollouts")),
        ("Merge breaks", "Why a rollout's calls did not merge into one sample.",
         _bars([r for r, _ in data["merge_breaks"]], [float(n) for _, n in data["merge_breaks"]], "#f58518",
               x_label="reason", y_label="rollouts")),
        ("Staleness", "Calls by how many policy versions they are behind the newest in the store.",
         _bars([str(b) for b, _ in data["staleness"]], [float(n) for _, n in data["staleness"]], "#b279a2",
               x_label="policy versions behind", y_label="calls")),
        ("Calls by status", "",
         _bars([s for s, _ in data["call_status"]], [float(n) for _, n in data["call_status"]], "#9d755d",
               x_label="status", y_label="calls")),
        ("Refused calls", "Calls the proxy answered itself (status rejected), by HTTP status and reason "
         "(numbers shown as N): they never reached the policy.",
         _table(data["refused"])),
        ("Approximated in translation", "What the proxy approximated in calls it translated or fitted "
         "(calls.translation; numbers shown as N), most frequent first.",
         _table(data["approximated"])),
        ("Token capture", "Successful calls by how completely their tokens were recorded (full: "
         "token ids and a logprob per token; no_logprobs: the trainer recomputes the logprobs).",
         _bars([c for c, _ in data["capture"]], [float(n) for _, n in data["capture"]], "#72b7b2",
               x_label="capture", y_label="calls")),
        ("Egress", "What agents reached besides their LLM calls: requests per host, most first "
         "(blocked: refused by the proxy's egress policy).",
         _bars([h + ("" if a else " (blocked)") for h, a, _ in data["egress"]],
               [float(n) for _, _, n in data["egress"]], "#e45756", x_label="host", y_label="requests")),
    ]
    body = "".join(f"<section><h2>{html.escape(h)}</h2><p>{html.escape(d)}</p>{svg}</section>"
                   for h, d, svg in sections)
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}}
section{{display:inline-block;vertical-align:top;margin:0 2em 2em 0;width:{W}px}}h2{{font-size:1.1em}}
p{{color:#555;font-size:.9em;max-width:{W}px}}.empty{{color:#999;font-style:italic}}
table{{font-size:.8em;border-collapse:collapse}}td{{padding:2px 6px;vertical-align:top}}
td.n{{text-align:right;font-variant-numeric:tabular-nums}}</style></head>
<body><h1>{html.escape(title)}</h1>
<p>{t['calls']} calls · {t['rollouts']} rollout attempts · {t['rewarded_rollouts']} rewarded ·
{t['tokens']} tokens · made {when}</p>{body}</body></html>
"""


def write_report(con: duckdb.DuckDBPyConnection, out: str | os.PathLike, *, title: str,
                 build_report: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the page whole (temp file + rename); returns the numbers it shows."""
    data = report_data(con, build_report)
    write_atomic(out, render_html(data, title))
    return data
