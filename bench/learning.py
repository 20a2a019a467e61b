"""Does RL move the policy? One `lgt-train run`, then the warm start and the trained policy side by side.

Runs a run YAML (default examples/arith/run.yaml, its own stop rules: max_minutes, steps,
target_reward) and reports
- the training reward per step (what the agents earned, sampled at their own temperature 1.0): the mean
  of the first 10 steps and of the last 10 (what ``target_reward`` is held to), the best step, steps
  and wall-clock;
- the warm-start model and the run's last checkpoint evaluated on the same prompts with transformers
  (lgt.trainer.tiny.evaluate; arith: all 200 problems, calc: 200 fresh ones): greedy and sampled accuracy.

    .venv/bin/python bench/learning.py                               # arith, 10 minutes
    .venv/bin/python bench/learning.py --config examples/calc/run.yaml
    .venv/bin/python bench/learning.py --run-dir runs/arith-try6 --eval-only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def evaluate(model_dir: Path, task: str, n: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lgt.trainer.tiny import evaluate as tiny_evaluate

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    greedy = tiny_evaluate(model, tok, task, sample=False, n=n)
    sampled = tiny_evaluate(model, tok, task, sample=True, n=n)
    return {"greedy": greedy["accuracy"], "sampled": sampled["accuracy"], "format": sampled["format"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "examples" / "arith" / "run.yaml")
    ap.add_argument("--run-dir", type=Path, help="default runs/learning-<name>-<time>")
    ap.add_argument("--eval-only", action="store_true", help="only evaluate an existing run directory")
    ap.add_argument("--n", type=int, default=200, help="prompts evaluated")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to lgt-train run")
    args = ap.parse_args()

    from lgt.trainer import config as cfgmod
    from lgt.trainer.torch_backend import latest_checkpoint

    cfg = cfgmod.load(args.config)
    task = cfg.model.make.warm_start if cfg.model.make and cfg.model.make.warm_start else "arith"
    run_dir = args.run_dir or ROOT / "runs" / f"learning-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not args.eval_only:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        cmd = [sys.executable, "-m", "lgt.trainer.cli", "run", str(args.config), "--run-dir", str(run_dir)]
        cmd += [x for s in args.set for x in ("--set", s)]
        subprocess.run(cmd, check=True, env=env)
    run_cfg = json.loads((run_dir / "config.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    rewards = [r["rollout/reward_mean"] for r in rows]
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise SystemExit(f"{run_dir} has no checkpoint")
    model_dir = Path(run_cfg["model"]["path"])
    before, after = evaluate(model_dir, task, args.n), evaluate(ckpt, task, args.n)
    target = run_cfg.get("target_reward")
    last10 = statistics.fmean(rewards[-10:])
    print(f"\n{cfg.name}: {len(rows)} steps in {rows[-1]['time_s']:.0f} s "
          f"({sum(r['rollouts'] for r in rows)} rollouts trained; engine start excluded)")
    print(f"training reward (sampled by the agents): first 10 steps {statistics.fmean(rewards[:10]):.3f}, "
          f"last 10 steps {last10:.3f}, best step {max(rewards):.3f}")
    print(f"\n{'':28} {'greedy':>8} {'sampled':>8} {'format':>8}")
    for name, e in ((f"warm start ({model_dir.name})", before), (f"trained ({ckpt.name})", after)):
        print(f"{name:28} {e['greedy']:8.3f} {e['sampled']:8.3f} {e['format']:8.3f}")
    print(f"ratio (trained / warm start): greedy {after['greedy'] / max(before['greedy'], 1e-9):.2f}x, "
          f"sampled {after['sampled'] / max(before['sampled'], 1e-9):.2f}x")
    if target is not None:
        print(f"{'PASS' if last10 >= target else 'MISS'}: training reward (last 10 steps) >= {target} "
              f"({last10:.3f}, after {rows[-1]['time_s']:.0f} s)")
        print(f"{'PASS' if after['greedy'] >= target else 'MISS'}: greedy accuracy of the trained policy "
              f">= {target} ({after['greedy']:.3f})")
    (run_dir / "learning.json").write_text(json.dumps(
        {"steps": len(rows), "time_s": rows[-1]["time_s"], "reward_first10": statistics.fmean(rewards[:10]),
         "reward_last10": last10, "reward_best": max(rewards), "warm_start": before, "trained": after,
         "checkpoint": str(ckpt)}, indent=2))


if __name__ == "__main__":
    main()
