"""plots.py: the charts are well-formed standalone SVG with their titles, axis names, target and eval
series, for no rows, one row and many; the report page puts the summary first."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from lgt.testing.svg import SVG, parse, texts
from lgt.trainer.report import plots


def tooltips(root: ET.Element, prefix: str) -> list[str]:
    """The hover texts of the data points whose text starts with ``prefix`` (legend swatches have none)."""
    found = [c.find(f"{SVG}title") for c in root.iter(f"{SVG}circle")]
    return [t.text for t in found if t is not None and t.text.startswith(prefix)]


def rows_of(rewards: list[Any], seconds_per_step: float = 6.0) -> list[dict[str, Any]]:
    return [{"step": i + 1, "time_s": seconds_per_step * (i + 1), "rollout/reward_mean": r,
             "rollout/staleness_max": i % 3, "perf/drain_s": 0.5} for i, r in enumerate(rewards)]


EVALS = [{"step": 0, "time_s": 0.0, "eval/reward_greedy": 0.2, "eval/reward_sampled": 0.1},
         {"step": 40, "time_s": 240.0, "eval/reward_greedy": 0.9, "eval/reward_sampled": None}]


@pytest.mark.parametrize("n", [0, 1, 60])
def test_reward_chart_has_its_labels_for_any_number_of_rows(n: int) -> None:
    rows = rows_of([min(1.0, 0.2 + i / 50) for i in range(n)])
    minutes = plots.points([r["step"] for r in rows], [r["time_s"] for r in rows])
    root = parse(plots.reward_chart(rows, EVALS, 0.9, minutes))
    words = texts(root)
    for label in ("Reward per training step", "training step", "mean reward",
                  "minutes since training started", "target 0.9", "held-out eval, greedy",
                  "held-out eval, sampled"):
        assert label in words, label
    assert ("training reward, 10-step mean" in words) == (n > 0)
    assert len(tooltips(root, "training reward per step")) == n
    # eval at step 0 is drawn at x = 0, the left edge of the plot (which starts at step 0)
    (step0,) = [c for c in root.iter(f"{SVG}circle") if c.find(f"{SVG}title") is not None
                and c.find(f"{SVG}title").text == "held-out eval, greedy, step 0: 0.200"]
    assert float(step0.get("cx")) == 64.0 and "0" in words


def test_reward_chart_without_rows_eval_or_target() -> None:
    root = parse(plots.reward_chart([], None, None))
    words = texts(root)
    assert "no steps yet" in words and "Reward per training step" in words
    assert not [w for w in words if w.startswith("target") or "eval" in w]


def test_many_rows_top_scale_minutes_and_trend() -> None:
    rows = rows_of([0.0] * 5 + [1.0] * 15)  # 6 s a step: half a minute is 5 steps
    svg = plots.reward_chart(rows, None, 0.9, plots.points([r["step"] for r in rows],
                                                           [r["time_s"] for r in rows]))
    root = parse(svg)
    assert plots.minute_ticks([(r["step"], r["time_s"]) for r in rows], 1, 20) == [
        (5.0, "0.5"), (10.0, "1"), (15.0, "1.5"), (20.0, "2")]
    assert {"0.5", "1.5", "training reward per step", "training reward, 10-step mean"} <= set(texts(root))
    bold = [p for p in root.iter(f"{SVG}polyline") if p.get("stroke-width") == "2.8"]
    assert len(bold) == 1 and len(bold[0].get("points").split()) == 20  # one trailing mean per step
    assert len([ln for ln in root.iter(f"{SVG}line") if ln.get("stroke-dasharray") == "7 4"]) == 1  # target


def test_missing_values_are_skipped_and_equal_values_get_a_span() -> None:
    rows = rows_of([0.5, None, float("nan"), 0.5, 0.5])
    root = parse(plots.reward_chart(rows))
    assert sorted(tooltips(root, "training reward per step")) == [
        f"training reward per step, step {s}: 0.500" for s in (1, 4, 5)]
    flat = plots.line_chart("Flat", [plots.Series("s", [(1, 3.0), (2, 3.0)], "#000")], y_label="y")
    assert "nan" not in flat.lower() and len(texts(parse(flat))) > 3
    assert plots.axis(3.0, 3.0)[:2] == (2.6, 3.4) and plots.axis(0.0, 0.0)[:2] == (0.0, 0.5)
    assert plots.axis(0.0, 1.0) == (0.0, 1.0, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert plots.axis(1, 89, 8, integer=True, expand=False) == (1, 89, [20, 40, 60, 80])


def test_text_is_escaped() -> None:
    root = parse(plots.line_chart("a < b & c", [plots.Series("<x>", [(1, 1.0)], "#000"),
                                                plots.Series("y&z", [(1, 2.0)], "#111")], y_label="\"q\""))
    assert {"a < b & c", "<x>", "y&z", '"q"'} <= set(texts(root))


def test_all_charts_have_titles_and_axis_names() -> None:
    rows = rows_of([0.1, 0.2, 0.3])
    made = plots.charts(rows, [0.5, 1.0, 2.0, 8.0, float("nan")], EVALS, 0.9)
    assert list(made) == ["reward", "rollout_duration", "staleness", "drain_seconds"]
    expect = {"rollout_duration": ("Rollout duration", "seconds per rollout (log-spaced bins)", "rollouts"),
              "staleness": ("Staleness", "training step", "policy versions behind"),
              "drain_seconds": ("Drain time per update", "training step", "seconds")}
    for name, labels in expect.items():
        words = texts(parse(made[name][1]))
        assert set(labels) <= set(words), (name, words)
    bars = list(parse(made["rollout_duration"][1]).iter(f"{SVG}rect"))
    assert sum(float(r.find(f"{SVG}title").text.rsplit(": ", 1)[1]) for r in bars if r.find(f"{SVG}title")
               is not None) == 4  # the NaN duration is left out
    empty = plots.charts([], [])
    for _, svg in empty.values():
        parse(svg)
    assert "no rollouts yet" in texts(parse(empty["rollout_duration"][1]))


def test_duration_histogram() -> None:
    edges, counts = plots.duration_histogram([1.0, 2.0, 4.0, 8.0, None], bins=3)
    assert len(edges) == 4 and math.isclose(edges[0], 1.0) and math.isclose(edges[-1], 8.0)
    assert counts == [1.0, 1.0, 2.0]
    assert plots.duration_histogram([3.0, 3.0]) == ([3.0, 3.0], [2.0])
    assert plots.duration_histogram([]) == ([], [])


def test_run_report_puts_the_summary_first(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"name": "ar<ith>", "target_reward": 0.9}))
    rows = rows_of([0.0] * 5 + [1.0] * 15)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2')
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVALS))
    (run / "rollouts.jsonl").write_text("".join(json.dumps({"seconds": s}) + "\n" for s in (1, 2, 3)))
    (run / "summary.json").write_text(json.dumps({"stopped": "time limit (15 min)"}))
    page = plots.write_run_report(run, rows).read_text()
    assert "ar&lt;ith&gt;: reached the target 0.9 at step 14 (1.4 min); stopped: time limit (15 min)" in page
    assert page.index('class="summary"') < page.index("Reward per training step") < \
        page.index("Rollout duration") and "store-report.html" not in page
    for name in ("reward", "rollout_duration", "staleness", "drain_seconds"):
        root = parse((run / "plots" / f"{name}.svg").read_text())
        assert root.get("width") and root.find(f"{SVG}title").text
    (run / "store-report.html").write_text("<html></html>")
    assert 'href="store-report.html"' in plots.write_run_report(run, rows).read_text()
