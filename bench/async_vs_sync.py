"""Collocated async vs sync RL on the same workload, side by side in one run; prints the ratio.

Workload: examples/calc's agent on its tasks or examples/arith's (``--agent``), the model built by
``lgt-train make-model`` (demo preset, warm-started), rollout durations with a heavy tail — the agent's
environment sleeps ``scale · Pareto(shape)`` seconds per rollout (``--latency pareto:SCALE:SHAPE``),
as real tools do. Both modes get the same config, seed, task order and number of trained samples
(``--steps`` × ``--batch-groups`` × ``--group-size``); the figure is the wall-clock to train them
(engine start excluded) and the reward reached (mean of the last 3 steps). ``--latency-seed N`` draws
each rollout's time from N and its id, so that every mode meets the same times (without it each
draws its own, and the slowest rollouts of sync's steps, which set its pace, differ from run to run).

Async runs once per way of bounding staleness (``--modes``: ``async-group``, ``async-mask``,
``async-truncate``; plain ``async`` takes the config's default): ``group`` is lgt's admission before
per-token versions (a group with one token more than ``max_staleness`` versions behind is dropped
whole), ``mask`` leaves only such tokens out of the loss, ``truncate`` trains them with their truncated
importance weight. A ``+continue`` suffix (``async-truncate+continue``) runs it with the run config's
``proxy.on_update: continue``: the calls in flight at an update stopped and continued by the proxy on
the new weights instead of drained. Each prints the share of the generated tokens of its trained
batches that were trained (``rollout/tokens_trained`` over ``rollout/tokens_generated``), the seconds
per trained sample, and its speed-up over sync per trained sample.

    .venv/bin/python bench/async_vs_sync.py --steps 12
    .venv/bin/python bench/async_vs_sync.py --steps 10 --latency-seed 1   # the same times in every mode
    .venv/bin/python bench/async_vs_sync.py --steps 6 --modes sync,async-group,async-truncate   # quicker
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
    """The run config of ``mode``: ``sync``, ``async``, or ``async-<staleness>``; a ``+continue`` suffix
    sets ``proxy.on_update: continue`` (the calls in flight at an update continued, not drained)."""
    mode, _, on_update = mode.partition("+")
    run_mode, _, staleness = mode.partition("-")
    agent_dir = ROOT / "examples" / args.agent
    env = {"OPENAI_BASE_URL": "https://api.openai.invalid/v1", "OPENAI_API_KEY": "sk-bench",
           "AGENT_LATENCY": args.latency, "CALC_TOOL_LATENCY": args.latency}
    if args.latency_seed is not None:  # every mode meets the same environment times, rollout by rollout
        env["AGENT_LATENCY_SEED"] = str(args.latency_seed)
    return {
        "name": f"bench-{mode}", "mode": run_mode, "seed": args.seed,
        "model": {"path": str(args.model), "make": {"preset": "demo", "warm_start": args.agent,
                                                     "seconds": 180, "seed": 0}},
        "tasks": str(agent_dir / "tasks.jsonl"),
        "agent": {"command": [sys.executable, str(agent_dir / "agent.py")], "env": env,
                  "python_preload": ["auto"], "timeout_s": 300, "retries": 1},
        "group_size": args.group_size, "batch_groups": args.batch_groups, "steps": args.steps,
        "max_inflight": args.max_inflight, "max_staleness": args.max_staleness,
        **({"staleness": staleness} if staleness else {}),
        "engine": {"max_model_len": 512, **({"extra_args": ["--enable-auto-tool-choice", "--tool-call-parser",
                                                            "hermes"]} if args.agent == "calc" else {})},
        "backend": {"lr": args.lr, "micro_batch_tokens": 8192},
        "algorithm": {"sample_mode": "realign" if args.agent == "calc" else "exact", "agg": "token-mean"},
        **({"proxy": {"on_update": on_update}} if on_update else {}),
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
    generated = sum(r.get("rollout/tokens_generated", 0) for r in rows)
    trained = sum(r.get("rollout/tokens_trained", 0) for r in rows)
    samples = sum(r["samples"] for r in rows)
    return {
        "mode": mode, "steps": len(rows), "train_wall_s": rows[-1]["time_s"],
        "total_s_incl_setup": round(time.monotonic() - t, 1),
        "samples": samples, "s_per_sample": round(rows[-1]["time_s"] / max(samples, 1), 4),
        "tokens_generated": generated, "tokens_trained": trained,
        "tokens_trained_frac": round(trained / generated, 4) if generated else None,
        "tokens_stale_masked": sum(r.get("rollout/tokens_stale_masked", 0) for r in rows),
        "tokens_past_bound": sum(r.get("rollout/tokens_past_bound", 0) for r in rows),
        "versions_spanned_max": max(r.get("rollout/versions_spanned_max", 0) for r in rows),
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
    ap.add_argument("--latency-seed", type=int, default=None,
                    help="draw each rollout's environment time from this seed and its id (the arith and "
                         "calc agents' AGENT_LATENCY_SEED): sync and async then meet the same times")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "runs" / f"bench-async-{time.strftime('%Y%m%d-%H%M%S')}")
    ap.add_argument("--modes", default="sync,async-group,async-mask,async-truncate",
                    help="sync, async (the config's default staleness) or async-group|mask|truncate, "
                         "comma-separated; sync first so that each async run trains as many samples")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    results: dict[str, dict] = {}
    for m in args.modes.split(","):
        target = results["sync"]["samples"] if m.startswith("async") and "sync" in results else None
        results[m] = run_mode(args, m, target)
    for r in results.values():
        print(json.dumps(r))
    print(table(results))
    (args.out / "results.json").write_text(json.dumps(results, indent=2))


def table(results: dict[str, dict]) -> str:
    """Each run's figures side by side; the speed-up over sync per trained sample, and each async run's
    share of trained tokens and speed against ``async-group`` (today's admission) when both ran."""
    lines = ["", "| run | trained samples | train s | s / sample | vs sync | tokens trained / generated "
             "| masked for staleness | past the bound | reward last 3 |", "|---" * 9 + "|"]
    sync, group = results.get("sync"), results.get("async-group")
    for name, r in results.items():
        vs_sync = f"{sync['s_per_sample'] / r['s_per_sample']:.2f}x" if sync and r["s_per_sample"] else "-"
        frac = "-" if r["tokens_trained_frac"] is None else f"{r['tokens_trained_frac']:.4f}"
        lines.append(f"| {name} | {r['samples']} | {r['train_wall_s']:.1f} | {r['s_per_sample']:.4f} "
                     f"| {vs_sync} | {r['tokens_trained']}/{r['tokens_generated']} = {frac} "
                     f"| {r['tokens_stale_masked']} | {r['tokens_past_bound']} | {r['reward_last3']:.3f} |")
    if group:
        for name, r in results.items():
            if name.startswith("async") and name != "async-group" and r["s_per_sample"]:
                lines.append(f"{name} vs async-group: {group['s_per_sample'] / r['s_per_sample']:.2f}x per "
                             f"trained sample, tokens trained {r['tokens_trained_frac']} vs "
                             f"{group['tokens_trained_frac']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
