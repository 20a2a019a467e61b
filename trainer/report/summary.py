"""A run's outcome in a few figures: ``<run>/summary.json`` and the lines printed at the end of a run.

Computed from what the run wrote into its directory: ``config.json`` (name, target), ``metrics.jsonl``
(one row per training step), ``eval.jsonl`` (held-out evaluations, may be absent). Whether the target
was reached follows the trainer's own rule: the mean reward of the last 10 steps (steps with no finite
reward left out) reaches ``target_reward``.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

from lgt.store.files import write_atomic

WINDOW = 10  # steps in the trailing mean that decides the target (the trainer's TARGET_WINDOW)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file; lines that do not parse (a line cut off by a crash) are left out."""
    return jsonl_rows(path.read_bytes()) if path.exists() else []


def jsonl_rows(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects of ``data``'s lines; a line that is not one is left out."""
    rows = []
    for line in data.splitlines():
        with contextlib.suppress(ValueError):  # JSONDecodeError, or bytes that are not UTF-8
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    return rows


def read_json(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, json.JSONDecodeError):
        obj = json.loads(path.read_text())
        if isinstance(obj, dict):
            return obj
    return {}


def number(v: Any) -> float | None:
    """``v`` as a finite float, else None (missing, null, NaN, inf, not a number)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def trailing_means(values: list[float | None], window: int = WINDOW) -> list[tuple[float | None, int]]:
    """At each position: (mean, n) of the last up to ``window`` finite values so far (None, 0 before any)."""
    out, recent = [], []
    for v in values:
        if v is not None:
            recent = [*recent[-window + 1:], v]
        out.append((sum(recent) / len(recent) if recent else None, len(recent)))
    return out


def _eval_point(row: dict[str, Any] | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {"step": row.get("step"), "greedy": number(row.get("eval/reward_greedy")),
            "sampled": number(row.get("eval/reward_sampled"))}


def summarize(run_dir: Path, *, stopped: str | None = None) -> dict[str, Any]:
    """The run's figures as a JSON-able dict (no NaN: a figure that cannot be computed is None)."""
    run_dir = Path(run_dir)
    cfg = read_json(run_dir / "config.json")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    target = number(cfg.get("target_reward"))
    rewards = [number(r.get("rollout/reward_mean")) for r in rows]
    finite = [v for v in rewards if v is not None]
    last10 = mean(finite[-WINDOW:])
    crossed = next((i for i, (m, n) in enumerate(trailing_means(rewards))
                    if target is not None and n == WINDOW and m >= target), None)
    times = [number(r.get("time_s")) for r in rows]
    last_time = next((t for t in reversed(times) if t is not None), None)

    def total(*keys: str) -> int:
        return int(sum(number(r.get(k)) or 0 for r in rows for k in keys))

    return {
        "name": cfg.get("name") or run_dir.name,
        "run_dir": str(run_dir),
        "stopped": stopped,
        "target": target,
        "reached": None if target is None else (len(finite) >= WINDOW and last10 >= target),
        "steps": max((int(r["step"]) for r in rows if number(r.get("step")) is not None), default=0),
        "minutes": None if last_time is None else last_time / 60,
        "rollouts_trained": total("rollouts"),
        "reward_first10": mean(finite[:WINDOW]),
        "reward_last10": last10,
        "steps_to_target": None if crossed is None else rows[crossed].get("step"),
        "seconds_to_target": None if crossed is None else times[crossed],
        "eval_before": _eval_point(evals[0] if evals else None),
        "eval_after": _eval_point(evals[-1] if evals else None),
        "stale_dropped": total("rollout/stale_dropped"),
        "failed": total("rollout/failed", "rollout/timeout"),
        "retried": total("rollout/retried"),
        "groups_failed": total("rollout/groups_failed"),  # none of its rollouts ok: never trained
        "isolation": _isolation(cfg),
        **({"teacher": teacher} if (teacher := _teacher(rows)) else {}),  # on-policy distillation's cost
    }


def _teacher(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The teacher's seconds, tokens and requests over the run's steps (its ``teacher/*`` metrics), or
    None for a run without a teacher."""
    rows = [r for r in rows if number(r.get("teacher/seconds")) is not None]
    if not rows:
        return None
    return {"seconds": round(sum(number(r.get("teacher/seconds")) or 0 for r in rows), 3),
            "tokens": int(sum(number(r.get("teacher/tokens")) or 0 for r in rows)),
            "requests": int(sum(number(r.get("teacher/requests")) or 0 for r in rows))}


def _isolation(cfg: dict[str, Any]) -> dict[str, Any]:
    """How the run's agents were held: their sandbox (local runner) and the proxy's egress policy."""
    agent, proxy = cfg.get("agent") or {}, cfg.get("proxy") or {}
    runner = agent.get("runner", "local")
    sandbox = (agent.get("sandbox") or {}).get("kind", "bwrap") if runner == "local" else "kubernetes pods"
    egress = None if proxy.get("url") else proxy.get("egress", "allowlist")
    if egress == "allowlist" and not proxy.get("allow_hosts"):
        egress = "deny"
    return {"sandbox": sandbox, "egress": egress}


def _f(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _headline(s: dict[str, Any]) -> str:
    target, last10 = s.get("target"), _f(s.get("reward_last10"))
    if target is None:
        outcome = f"training reward last 10 steps {last10} (no target)"
    elif s.get("reached") and s.get("steps_to_target") is not None:
        when = "" if s.get("seconds_to_target") is None else f" ({s['seconds_to_target'] / 60:.1f} min)"
        outcome = f"reached the target {target:g} at step {s['steps_to_target']}{when}"
    elif s.get("reached"):
        outcome = f"reached the target {target:g}: last 10 steps {last10}"
    else:
        outcome = f"did not reach the target {target:g}: last 10 steps {last10}"
        if s.get("steps_to_target") is not None:
            outcome += f" (its 10-step mean first reached it at step {s['steps_to_target']})"
    stopped = f"; stopped: {s['stopped']}" if s.get("stopped") else ""
    return f"{s.get('name')}: {outcome}{stopped}"


def _eval_line(before: dict[str, Any] | None, after: dict[str, Any] | None) -> str | None:
    if before is None or after is None:
        return None
    same = before.get("step") == after.get("step")
    parts = [f"{kind} {_f(before.get(kind))}" + ("" if same else f" → {_f(after.get(kind))}")
             for kind in ("greedy", "sampled") if before.get(kind) is not None or after.get(kind) is not None]
    steps = f"step {before.get('step')}" + ("" if same else f" → step {after.get('step')}")
    return f"  held-out eval    {'   '.join(parts) or 'no rewards'}   ({steps})"


def _isolation_line(iso: dict[str, Any] | None) -> str | None:
    if not iso:
        return None
    sandbox = {"bwrap": "sandboxed (bwrap)", "none": "NOT sandboxed (agent.sandbox: none)"}.get(
        iso.get("sandbox"), str(iso.get("sandbox")))
    egress = iso.get("egress")
    return f"  agents           {sandbox}" + ("" if egress is None else f" · egress {egress}")


def render(summary: dict[str, Any]) -> str:
    """A few plain-text lines to read at a glance at the end of a run."""
    s = summary
    minutes = "" if s.get("minutes") is None else f", {s['minutes']:.1f} min"
    lines = [
        _headline(s),
        f"  training reward  first 10 steps {_f(s.get('reward_first10'))} → last 10 steps "
        f"{_f(s.get('reward_last10'))}   ({s.get('steps', 0)} steps, {s.get('rollouts_trained', 0):,} "
        f"rollouts{minutes})",
        _eval_line(s.get("eval_before"), s.get("eval_after")),
        f"  dropped stale {s.get('stale_dropped', 0)} · failed {s.get('failed', 0)} · "
        f"retried {s.get('retried', 0)}"
        + (f" · groups that failed whole (not trained) {n}" if (n := s.get("groups_failed")) else ""),
        _isolation_line(s.get("isolation")),
        f"  run directory    {s.get('run_dir')}  (report.html, plots/, metrics.csv, checkpoints/)",
    ]
    return "\n".join(line for line in lines if line is not None)


def write(run_dir: Path, stopped: str | None = None) -> dict[str, Any]:
    """Summarize the run into ``<run>/summary.json`` (atomically) and return the summary. Without
    ``stopped``, the reason already recorded there is kept (a later re-render does not lose it)."""
    run_dir = Path(run_dir)
    path = run_dir / "summary.json"
    if stopped is None:
        stopped = read_json(path).get("stopped")
    summary = summarize(run_dir, stopped=stopped)
    write_atomic(path, json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return summary
