"""Does RL move the policy, on tasks it never trained on? `lgt-train run` once per seed, one table.

Runs a run YAML (default examples/carry/run.yaml, the demo's; its own stop rules: target_reward,
max_minutes, steps) once per seed and reads each run's summary.json and eval.jsonl: steps and seconds of
training to reach the target (the mean training reward of 10 steps, sampled by the agents at their own
temperature), and the held-out evaluation (the config's ``eval`` section: tasks split off, never
trained on; greedy and sampled) before the first update → after the last.

    .venv/bin/python bench/learning.py --seeds 0,1,2                 # the demo, three seeds
    .venv/bin/python bench/learning.py --seeds 0,1,2 --mode sync     # the synchronous baseline
    .venv/bin/python bench/learning.py --config examples/calc/run.yaml --seeds 0
    .venv/bin/python bench/learning.py --config examples/arith/run.yaml --seeds 0   # single-digit facts
    .venv/bin/python bench/learning.py --report runs/learning-carry-*  # the table of finished runs

The seed picks the order of the training tasks and the agents' sampling; the model (built once by
model.make) and the held-out split are the same for every seed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(config: Path, run_dir: Path, seed: int, mode: str | None, sets: list[str]) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "lgt.trainer.cli", "run", str(config), "--run-dir", str(run_dir),
           "--set", f"seed={seed}"]
    if mode:
        cmd += ["--mode", mode]
    cmd += [x for s in sets for x in ("--set", s)]
    print(f"$ {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env=env)


def row(run_dir: Path) -> dict:
    from lgt.trainer.report import summary

    s = summary.summarize(run_dir)
    cfg = json.loads((run_dir / "config.json").read_text())
    before, after = s.get("eval_before") or {}, s.get("eval_after") or {}
    return {"run": run_dir.name, "seed": cfg.get("seed"), "mode": cfg.get("mode"), "target": s["target"],
            "steps_to_target": s["steps_to_target"], "seconds_to_target": s["seconds_to_target"],
            "steps": s["steps"], "seconds": None if s["minutes"] is None else s["minutes"] * 60,
            "reward_first10": s["reward_first10"], "reward_last10": s["reward_last10"],
            "greedy": (before.get("greedy"), after.get("greedy")),
            "sampled": (before.get("sampled"), after.get("sampled"))}


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "—" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    head = (f"{'seed':>4} {'mode':>5} {'to target':>17} {'steps (s)':>13} {'train reward':>15} "
            f"{'held-out greedy':>17} {'held-out sampled':>17}")
    lines = [head, "-" * len(head)]
    for r in rows:
        to = (f"step {r['steps_to_target']} ({r['seconds_to_target']:.0f} s)"
              if r["steps_to_target"] is not None else "not reached")
        g, s = r["greedy"], r["sampled"]
        lines.append(
            f"{r['seed']!s:>4} {r['mode']!s:>5} {to:>17} {r['steps']:>5} ({_f(r['seconds'], '.0f'):>4} s) "
            f"{_f(r['reward_first10'])} → {_f(r['reward_last10'])}   {_f(g[0])} → {_f(g[1])}      "
            f"{_f(s[0])} → {_f(s[1])}")
    reached = [r for r in rows if r["steps_to_target"] is not None]
    lines.append(f"reached the target {rows[0]['target']} in {len(reached)} of {len(rows)} runs"
                 + (f"; slowest {max(r['seconds_to_target'] for r in reached):.0f} s of training"
                    if reached else ""))
    rises = [r["sampled"][1] - r["sampled"][0] for r in rows if None not in r["sampled"]]
    if rises:
        lines.append(f"held-out sampled reward rose by {min(rises):+.3f} (least) to {max(rises):+.3f} (most)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "examples" / "carry" / "run.yaml")
    ap.add_argument("--seeds", default="0", help="comma-separated run seeds (default 0)")
    ap.add_argument("--mode", choices=["sync", "async"], help="override the config's mode")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to lgt-train run")
    ap.add_argument("--report", nargs="+", type=Path, metavar="RUN_DIR", help="only tabulate finished runs")
    args = ap.parse_args()

    if args.report:
        print(table([row(d) for d in args.report]))
        return
    from lgt.trainer import config as cfgmod

    cfg = cfgmod.load(args.config)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dirs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        run_dir = ROOT / "runs" / f"learning-{cfg.name}-{args.mode or cfg.mode}-s{seed}-{stamp}"
        run(args.config, run_dir, seed, args.mode, args.set)
        dirs.append(run_dir)
    print()
    print(table([row(d) for d in dirs]))


if __name__ == "__main__":
    main()
