"""The run's record as it goes, and at its end: what a person reads during and after a run.

:class:`RunLog` writes one ``metrics.jsonl`` row per training step and one ``rollouts.jsonl`` row per
rollout, shows log lines and the live status line (:func:`default_display`), keeps the mean reward
of the last steps (``target_reward``) and passes the steps, the evaluations and the end of the run to
the experiment trackers (:mod:`lgt.trainer.report.trackers`). :func:`finish` turns what the run wrote
into ``summary.json``, ``metrics.csv``, the plots and the report pages.
(:mod:`lgt.trainer.run.stopping` says when training ends.)
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lgt.store.files import atomic_path, write_atomic
from lgt.store.query import connect
from lgt.trainer.report.summary import read_jsonl
from lgt.trainer.report.trackers import Trackers
from lgt.trainer.run.stopping import TARGET_WINDOW


@dataclass
class StepStats:
    """What the progress display shows."""

    step: int = 0
    version: int = 0
    running: int = 0
    done: int = 0
    failed: int = 0
    reward_mean: float = float("nan")
    staleness: float = 0.0
    drain_s: float = 0.0
    tokens_per_s: float = 0.0


Display = Callable[[StepStats, str], None]


class RunLog:
    """``run_dir``'s metrics.jsonl and rollouts.jsonl, the display's log lines and status line.

    ``steps``: the run's step limit (the status line says "step 3/20"); ``counts``: running, done and
    failed rollouts for the status line (:meth:`follow`, once the scheduler exists); ``trackers``: the
    run config's ``log`` (started by :meth:`start_trackers`, closed by :meth:`close`)."""

    def __init__(self, run_dir: Path, display: Display | None = None, *, steps: int = 0,
                 trackers: Sequence[str] = ()) -> None:
        self.run_dir = run_dir
        self.display = display or (lambda stats, line: None)
        self.steps = steps
        self.stats = StepStats()
        self.recent_rewards: list[float] = []  # mean reward of the last steps (target_reward)
        self.t0 = time.monotonic()
        self._counts: Callable[[], tuple[int, int, int]] | None = None
        self.trackers = Trackers(trackers, say=self.log)

    def start_trackers(self, config: dict[str, Any], resume_step: int | None = None) -> None:
        """The trackers begin with the run ``config``; a resumed run's (at ``resume_step``) continue."""
        self.trackers.start(self.run_dir, config, resume_step)

    def eval(self, row: Mapping[str, Any]) -> None:
        """An evaluation's eval.jsonl row (written by the evaluator), for the trackers."""
        self.trackers.eval(row)

    def close(self, stopped: str | None) -> None:
        """The trackers get the summary and the plots (:func:`finish` wrote them) and end their runs."""
        self.trackers.finish(self.run_dir, stopped)

    def follow(self, counts: Callable[[], tuple[int, int, int]]) -> None:
        self._counts = counts

    def restart_clock(self) -> None:
        """``time_s`` counts from now (training: the engine's start and the first evaluation excluded)."""
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def restore(self, step: int) -> None:
        """A resumed run's recent rewards: the metrics rows up to its checkpoint's ``step``."""
        rows = metric_rows(self.run_dir)
        rewards = [r.get("rollout/reward_mean") for r in rows if r.get("step", 0) <= step]
        self.recent_rewards = [x for x in rewards if isinstance(x, (int, float)) and math.isfinite(x)
                               ][-TARGET_WINDOW:]

    def log(self, line: str) -> None:
        self.display(self.stats, line)

    def refresh(self, line: str = "") -> None:
        if self._counts is not None:
            s = self.stats
            s.running, s.done, s.failed = self._counts()
        self.display(self.stats, line)

    def rollout(self, res: Any) -> None:
        """One rollout's result (the controller's), a line of rollouts.jsonl."""
        with open(self.run_dir / "rollouts.jsonl", "a") as f:
            f.write(json.dumps(_result_row(res), default=str) + "\n")

    def trained(self, step: int, version: int, samples: Any) -> None:
        """What a step trained on, a line of trained.jsonl per sample (``samples``: the admitted table):
        the advantage and loss weight the loss gave it, for the live page's trajectory view."""
        if not samples.num_rows:
            return
        cols = [c for c in ("sample_id", "rollout_id", "attempt", "group_id", "reward", "advantage",
                            "loss_weight") if c in samples.column_names]
        with open(self.run_dir / "trained.jsonl", "a") as f:
            for r in samples.select(cols).to_pylist():
                f.write(json.dumps({"step": step, "version": version, **r}, default=str) + "\n")

    def step(self, row: Mapping[str, Any]) -> None:
        """A training step's metrics row: appended to metrics.jsonl, shown on one line."""
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        s = self.stats
        s.step, s.version = row["step"], row["version"]
        s.reward_mean = row.get("rollout/reward_mean", float("nan"))
        if not math.isnan(s.reward_mean):
            self.recent_rewards = [*self.recent_rewards[-TARGET_WINDOW + 1:], s.reward_mean]
        s.staleness = row.get("rollout/staleness_max", 0)
        s.drain_s = row["perf/drain_s"]
        s.tokens_per_s = row.get("perf/tokens_per_s", row.get("tokens_per_s", 0.0))
        self.refresh(f"step {s.step}/{self.steps}  reward {s.reward_mean:.3f}  "
                     f"samples {row['samples']}  staleness≤{s.staleness}  drain {s.drain_s:.2f}s  "
                     f"train {row['perf/train_s']:.2f}s  sync {row['perf/sync_s']:.2f}s{distill_text(row)}")
        self.trackers.step(row)


def distill_text(row: Mapping[str, Any]) -> str:
    """On-policy distillation's part of the step's line: the reverse KL to the teacher and the seconds
    the teacher took ('' without a teacher)."""
    if "opd/reverse_kl" not in row:
        return ""
    return f"  reverse KL {row['opd/reverse_kl']:.3f}  teacher {row.get('teacher/seconds', 0.0):.2f}s"


def step_row(*, step: int, version: int, time_s: float, columns: Mapping[str, Any], groups: int,
             prepared: Mapping[str, Any], results: list[Any], groups_failed: int, sample_ids: list[str],
             running: int, pause: Mapping[str, Any], perf: Mapping[str, float], update_s: float,
             paused_s: float, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A step's metrics.jsonl row: the batch (``prepared``: :meth:`~.admission.Prepared.metrics`; its
    rollouts' ``results``), the pause's answer, the time of each part (``perf``), and the backend's
    numeric ``metrics``."""
    info = {"groups": groups, **prepared,
            "rollout/failed": sum(1 for r in results if r.status == "failed"),
            "rollout/timeout": sum(1 for r in results if r.status == "timeout"),
            "rollout/retried": sum(1 for r in results if r.attempt > 0),
            "rollout/groups_failed": groups_failed,  # since the last step: none of its rollouts ok
            "rollout/duration_mean": round(sum(r.seconds for r in results) / max(len(results), 1), 3),
            "sample_ids": sample_ids}
    return {
        "step": step, "version": version, "time_s": round(time_s, 3), **columns, **info,
        "rollout/running": running,
        "perf/drain_s": pause.get("drain_seconds", 0.0),
        "perf/in_flight_at_pause": pause.get("in_flight_at_pause", 0),
        "perf/undrained_calls": 0 if pause.get("drained", True) else pause.get("in_flight", 0),
        **perf, "perf/update_s": round(update_s, 4), "perf/paused_s": round(paused_s, 4),
        **{k: v for k, v in metrics.items() if isinstance(v, (int, float))},
    }


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl rows (a last line cut off by a crash is left out)."""
    return read_jsonl(run_dir / "metrics.jsonl")


def finish(run_dir: Path, store: Path | None = None, stopped: str | None = None) -> None:
    """summary.json, metrics.csv, plots and the report page from what the run wrote."""
    from lgt.store.report import write_report
    from lgt.trainer.report import plots, summary

    summary.write(run_dir, stopped=stopped)
    if store is not None and store.exists():
        con = connect(store)
        try:
            write_report(con, run_dir / "store-report.html", title=f"{run_dir.name}: store")
        finally:
            con.close()

    rows = metric_rows(run_dir)
    if rows:
        cols = sorted({k for r in rows for k in r if k != "sample_ids"},
                      key=lambda k: (k not in ("step", "version", "time_s"), k))
        with atomic_path(run_dir / "metrics.csv") as tmp, open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    plots.write_run_report(run_dir, rows)


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON in ``path``, whole or not at all."""
    write_atomic(path, json.dumps(obj, indent=2, default=str))


def _result_row(res: Any) -> dict[str, Any]:
    return dataclasses.asdict(res) if dataclasses.is_dataclass(res) else dict(vars(res))


def default_display(stream: Any = None) -> Display:
    """One line per event on a non-terminal; a live status line on a terminal (rich)."""
    stream = stream or sys.stderr
    if not stream.isatty():
        def show(stats: StepStats, line: str) -> None:
            if line:
                print(line, file=stream, flush=True)
        return show
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console(file=stream)
    live = Live(console=console, refresh_per_second=4, transient=True)
    live.start()

    def show(stats: StepStats, line: str) -> None:
        if line:
            live.console.print(line)
        live.update(Text(
            f"step {stats.step}  v{stats.version}  rollouts running {stats.running}  done {stats.done}  "
            f"failed {stats.failed}  reward {stats.reward_mean:.3f}  staleness {stats.staleness}  "
            f"drain {stats.drain_s:.2f}s  {stats.tokens_per_s:.0f} tok/s"))
    show.live = live  # type: ignore[attr-defined]
    return show
