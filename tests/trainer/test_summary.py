"""summary.py on tiny hand-made run directories: the figures, the text, summary.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lgt.trainer.report import summary


def make_run(run_dir: Path, rewards: list[float | None], *, target: float | None = 0.9,
             evals: list[tuple[int, float | None, float | None]] | None = None,
             extra: dict[int, dict[str, Any]] | None = None, tail: str = "") -> Path:
    """A run directory: one metrics row per reward (step i+1 at 6 s per step), optional eval rows."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(
        {"name": "arith", "target_reward": target, "steps": 100, "max_minutes": 15, "mode": "async",
         "group_size": 4, "batch_groups": 2}))
    rows = [{"step": i + 1, "version": i + 1, "time_s": 6.0 * (i + 1),
             "rollout/reward_mean": float("nan") if r is None else r, "rollouts": 8, "samples": 8,
             "rollout/stale_dropped": 0, "rollout/failed": 0, "rollout/timeout": 0, "rollout/retried": 0,
             "rollout/staleness_max": 1, "perf/drain_s": 0.5, "sample_ids": ["x"],
             **(extra or {}).get(i + 1, {})} for i, r in enumerate(rewards)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    if evals is not None:
        (run_dir / "eval.jsonl").write_text("".join(json.dumps(
            {"step": s, "version": s, "time_s": 6.0 * s, "eval/reward_greedy": g, "eval/reward_sampled": p,
             "eval/tasks": 20, "eval/rollouts": 40, "eval/failed": 0, "eval/seconds": 3.0}) + "\n"
            for s, g, p in evals))
    return run_dir


# steps 1-5 reward 0, steps 6-20 reward 1: the trailing 10-step mean is 0.5 at step 10, 0.8 at 13,
# 0.9 at step 14 (steps 5..14 hold nine ones): the target 0.9 is reached at step 14, 84 s in.
RISING = [0.0] * 5 + [1.0] * 15


def test_figures_of_a_run_that_reaches_its_target(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", RISING, evals=[(0, 0.2, 0.1), (10, 0.5, 0.4), (20, 0.95, 0.8)],
                   extra={3: {"rollout/failed": 1}, 4: {"rollout/timeout": 2}, 7: {"rollout/retried": 1},
                          9: {"rollout/stale_dropped": 4}})
    s = summary.summarize(run, stopped="reached the target")
    assert s == {
        "name": "arith", "run_dir": str(run), "stopped": "reached the target", "target": 0.9,
        "reached": True, "steps": 20, "minutes": 2.0, "rollouts_trained": 160,
        "reward_first10": 0.5, "reward_last10": 1.0, "steps_to_target": 14, "seconds_to_target": 84.0,
        "eval_before": {"step": 0, "greedy": 0.2, "sampled": 0.1},
        "eval_after": {"step": 20, "greedy": 0.95, "sampled": 0.8},
        "stale_dropped": 4, "failed": 3, "retried": 1, "groups_failed": 0,
        "isolation": {"sandbox": "bwrap", "egress": "deny"},  # the defaults: the config names neither
    }
    text = summary.render(s)
    assert text.splitlines()[0] == \
        "arith: reached the target 0.9 at step 14 (1.4 min); stopped: reached the target"
    for part in ("first 10 steps 0.50 → last 10 steps 1.00", "(20 steps, 160 rollouts, 2.0 min)",
                 "greedy 0.20 → 0.95", "sampled 0.10 → 0.80", "(step 0 → step 20)",
                 "dropped stale 4 · failed 3 · retried 1", f"run directory    {run}"):
        assert part in text, part


def test_the_target_counts_only_full_windows(tmp_path: Path) -> None:
    s = summary.summarize(make_run(tmp_path / "run", [1.0] * 12))
    assert s["steps_to_target"] == 10 and s["seconds_to_target"] == 60.0 and s["reached"] is True
    short = summary.summarize(make_run(tmp_path / "short", [1.0] * 9))
    assert short["steps_to_target"] is None and short["seconds_to_target"] is None


def test_unreached_target(tmp_path: Path) -> None:
    s = summary.summarize(make_run(tmp_path / "run", [0.8] * 15), stopped="step limit")
    assert s["reached"] is False and s["steps_to_target"] is None and s["seconds_to_target"] is None
    assert math.isclose(s["reward_last10"], 0.8)
    assert summary.render(s).splitlines()[0] == \
        "arith: did not reach the target 0.9: last 10 steps 0.80; stopped: step limit"


def test_reached_then_fell_below(tmp_path: Path) -> None:
    s = summary.summarize(make_run(tmp_path / "run", RISING + [0.0] * 5))  # last 10: five 1s, five 0s
    assert s["reached"] is False and s["steps_to_target"] == 14 and s["reward_last10"] == 0.5
    assert "did not reach the target 0.9: last 10 steps 0.50 (its 10-step mean first reached it at " \
           "step 14)" in summary.render(s)


def test_no_target_no_eval_and_a_cut_off_last_line(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", [0.25, None, 0.75], target=None, tail='{"step": 4, "rollout/rew')
    s = summary.summarize(run)
    assert s["steps"] == 3 and s["rollouts_trained"] == 24 and s["minutes"] == 0.3
    assert s["target"] is None and s["reached"] is None and s["steps_to_target"] is None
    assert s["reward_first10"] == 0.5 == s["reward_last10"]  # the NaN step is left out
    assert s["eval_before"] is None and s["eval_after"] is None
    text = summary.render(s)
    assert "no target" in text and "held-out eval" not in text and "stopped" not in text
    json.dumps(s, allow_nan=False)


def test_an_empty_run_directory(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    s = summary.summarize(tmp_path / "run")
    assert s["name"] == "run" and s["steps"] == 0 and s["minutes"] is None and s["rollouts_trained"] == 0
    assert s["reward_first10"] is None and s["reached"] is None
    assert "first 10 steps – → last 10 steps –" in summary.render(s)


def test_one_eval_row_and_greedy_off(tmp_path: Path) -> None:
    s = summary.summarize(make_run(tmp_path / "run", [0.5], evals=[(0, None, 0.3)]))
    assert s["eval_before"] == s["eval_after"] == {"step": 0, "greedy": None, "sampled": 0.3}
    line = next(x for x in summary.render(s).splitlines() if "held-out eval" in x)
    assert "sampled 0.30" in line and "greedy" not in line and "(step 0)" in line and "→" not in line


def test_write_keeps_the_recorded_stop_reason(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", [0.5, None])
    first = summary.write(run, stopped="time limit (15 min)")
    on_disk = json.loads((run / "summary.json").read_text(), parse_constant=lambda c: 1 / 0)  # no NaN
    assert on_disk == first and first["stopped"] == "time limit (15 min)"
    make_run(run, [0.5, None, 1.0])  # the run went on; a later re-render without a reason
    again = summary.write(run)
    assert again["stopped"] == "time limit (15 min)" and again["steps"] == 3
    assert summary.write(run, stopped="interrupted")["stopped"] == "interrupted"
    assert not list(run.glob(".*.tmp"))


def test_trailing_means() -> None:
    means = summary.trailing_means([1.0, None, 3.0, 5.0], window=2)
    assert means == [(1.0, 1), (1.0, 1), (2.0, 2), (4.0, 2)]
    assert summary.trailing_means([None]) == [(None, 0)]


def test_groups_that_failed_whole_are_counted_and_said(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", RISING, extra={2: {"rollout/groups_failed": 1},
                                                    5: {"rollout/groups_failed": 3}})
    s = summary.summarize(run)
    assert s["groups_failed"] == 4
    assert "groups that failed whole (not trained) 4" in summary.render(s)
    assert "failed whole" not in summary.render(summary.summarize(make_run(tmp_path / "ok", RISING)))
