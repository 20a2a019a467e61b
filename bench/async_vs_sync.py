"""Collocated async vs sync RL on the same workload, side by side in one run; prints the ratio.

Workload: examples/calc's agent on its tasks or examples/arith's (``--agent``), the model built by
``lgt-train make-model`` (demo preset, warm-started), rollout durations with a heavy tail — the agent's
environment sleeps ``scale · Pareto(shape)`` seconds per rollout (``--latency pareto:SCALE:SHAPE``),
as real tools do. Both modes get the same config, seed, task order and number of trained samples
(``--steps`` × ``--batch-groups`` × ``--group-size``); the figure is the wall-clock to train them
(engine start excluded) and the reward reached (mean of the last 3 steps).

    .venv/bin/python bench/async_vs_sync.py --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def config(args: argparse.Namespace, mode: str) -> dict:
    agent_dir = ROOT / "examples" / args.agent
    env = {"OPENAI_BASE_URL": "https://api.openai.invalid/v1", "OPENAI_API_KEY": "sk-bench",
           "AGENT_LATENCY": args.latency, "CALC_TOOL_LATENCY": args.latency}
    return {
        "name": f"bench-{mode}", "mode": mode, "seed": args.seed,
        "model": {"path": str(args.model), "make": {"preset": "demo", "warm_start": args.agent,
                                                     "seconds": 180, "seed": 0}},
        "tasks": str(agent_dir / "tasks.jsonl"),
        "agent": {"command": [sys.executable, str(agent_dir / "agent.py")], "env": env,
                  "python_preload": ["auto"], "timeout_s": 300, "retries": 1},
        "group_size": args.group_size, "batch_groups": args.batch_groups, "steps": args.steps,
        "max_inflight": args.max_inflight, "max_staleness": args.max_staleness,
        "engine": {"max_model_len": 512, **({"extra_args": ["--enable-auto-tool-choice", "--tool-call-parser",
                                                            "hermes"]} if args.agent == "calc" else {})},
        "backend": {"lr": args.lr, "micro_batch_tokens": 8192},
        "algorithm": {"sample_mode": "realign" if args.agent == "calc" else "exact", "agg": "token-mean"},
    }


def run_mode(args: argparse.Namespace, mode: str, target_samples: float | None = None) -> dict:
    from lgt.trainer import config as cfgmod
    from lgt.trainer import preflight, recipe
    from lgt.trainer.run.runlog import default_display

    out = args.out / mode
    path = args.out / f"{mode}.yaml"
    raw = config(args, mode)
    if target_samples is not None:  # async may drop groups that went stale: run until it has trained as many
        raw["steps"], raw["max_samples"] = args.steps * 3, int(target_samples)
    path.write_text(yaml.safe_dump(raw))
    cfg = cfgmod.load(path)
    t = time.monotonic()
    recipe.run(cfg, preflight.validate(cfg, run_dir=out), run_dir=out, display=default_display())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    if target_samples is not None:
        total = 0.0
        for i, r in enumerate(rows):
            total += r["samples"]
            if total >= target_samples:
                rows = rows[: i + 1]
                break
    durations = [json.loads(x)["seconds"] for x in (out / "rollouts.jsonl").read_text().splitlines() if x]
    last = rows[-3:]
    return {
        "mode": mode, "steps": len(rows), "train_wall_s": rows[-1]["time_s"],
        "total_s_incl_setup": round(time.monotonic() - t, 1),
        "samples": sum(r["samples"] for r in rows),
        "reward_first": rows[0]["rollout/reward_mean"],
        "reward_last3": round(sum(r["rollout/reward_mean"] for r in last) / len(last), 3),
        "stale_dropped_groups": sum(r.get("rollout/stale_dropped", 0) for r in rows),
        "drain_s_mean": round(sum(r["perf/drain_s"] for r in rows) / len(rows), 3),
        "staleness_max": max(r["rollout/staleness_max"] for r in rows),
        "rollout_s_p50": sorted(durations)[len(durations) // 2],
        "rollout_s_max": max(durations),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agent", choices=["arith", "calc"], default="arith")
    ap.add_argument("--model", type=Path, default=ROOT / "runs" / "models" / "arith-demo")
    ap.add_argument("--latency", default="pareto:0.4:1.5")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--batch-groups", type=int, default=8)
    ap.add_argument("--max-inflight", type=int, default=192)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path,
                    default=ROOT / "runs" / f"bench-async-{time.strftime('%Y%m%d-%H%M%S')}")
    ap.add_argument("--modes", default="sync,async")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    results: dict[str, dict] = {}
    for m in args.modes.split(","):
        target = results["sync"]["samples"] if m == "async" and "sync" in results else None
        results[m] = run_mode(args, m, target)
    for r in results.values():
        print(json.dumps(r))
    if {"sync", "async"} <= set(results):
        s, a = results["sync"], results["async"]
        print(f"\nsame {s['samples']:.0f}/{a['samples']:.0f} trained samples: "
              f"sync {s['train_wall_s']:.1f} s, "
              f"async {a['train_wall_s']:.1f} s -> async is {s['train_wall_s'] / a['train_wall_s']:.2f}x "
              f"faster; reward (last 3 steps) sync {s['reward_last3']:.3f}, async {a['reward_last3']:.3f}")
    (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
