"""A real pretrained model learning through lgt on CPU: SmolLM2-135M-Instruct (docs/models.md).

    .venv/bin/python bench/real_model.py --seeds 0,1,2                 # the calc agent, three seeds
    .venv/bin/python bench/real_model.py --harness --seeds 0           # Claude Code
    .venv/bin/python bench/real_model.py --report runs/real-model-…    # the table of what finished

Each path runs the commands a user runs, as examples/smollm2_calc/run.yaml (the calc agent, its OpenAI
SDK) and examples/claude_code/smollm2.yaml (Claude Code on the write-a-word task) say:

1. the teacher: ``python -m lgt.testing.hosted_teacher``, a stand-in on loopback for a hosted model that
   does the task (no hosted model can be reached here; OpenAI chat completions for the calc agent,
   Anthropic Messages for Claude Code), and ``lgt-train record`` of the unchanged agent on it (once;
   every seed's SFT reads the same traces);
2. ``lgt-train sft`` of SmolLM2 on the rewarded traces: held-out success of the untrained model and of
   the warm start (the SFT's own evaluations, before and after);
3. ``lgt-train run --checkpoint <the SFT's run>``: RL from the warm start, with held-out evaluations
   during the run, for at most ``--rl-minutes`` of training.

The row per seed: held-out success (greedy / sampled) of the base, after SFT, and after RL (the run's
last evaluation), the RL's gain, and the minutes of each stage (SFT: training only; RL: the run's clock
from its first rollout, evaluations included). Goal (issue 44): RL adds ≥ 0.2 on 3 of 3 seeds within 30
minutes; Claude Code reaches ≥ 0.8 within 60 minutes of the whole path.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from lgt.testing.runs import lgt_train_shown, trainer_env
from lgt.trainer.serving import children

ROOT = Path(__file__).resolve().parents[1]
# each path's config, and the setting that aims its agent at the stand-in teacher
PATHS = {
    "calc": (ROOT / "examples" / "smollm2_calc" / "run.yaml",
             "agent.env.OPENAI_BASE_URL=http://127.0.0.1:{port}/v1"),
    "claude_code": (ROOT / "examples" / "claude_code" / "smollm2.yaml",
                    "agent.env.ANTHROPIC_BASE_URL=http://127.0.0.1:{port}"),
}


def record(path: str, out: Path) -> None:
    """The unchanged agent recorded on the stand-in teacher (once for every seed)."""
    config, aim = PATHS[path]
    d = out / "record"
    if not (d / "summary.json").exists():
        port = children.free_port()
        proc = subprocess.Popen([sys.executable, "-m", "lgt.testing.hosted_teacher", "--port", str(port)],
                                env=trainer_env(), start_new_session=True, stdout=subprocess.DEVNULL)
        try:
            _wait_port(port, proc)
            lgt_train_shown("record", str(config), "--per-task", "1", "--run-dir", str(d),
                            "--set", aim.format(port=port))
        finally:
            children.stop(proc, 30)


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    if children.wait_until(lambda: children.listens(port, timeout=1), proc, timeout, every=0.5):
        return
    if proc.returncode is not None:
        raise SystemExit(f"the stand-in teacher exited ({proc.returncode})")
    raise SystemExit(f"the stand-in teacher did not listen on {port}")


def seed_row(path: str, seed: int, out: Path, rl_minutes: float) -> dict:
    config = PATHS[path][0]
    sft_dir, rl_dir = out / f"sft-s{seed}", out / f"rl-s{seed}"
    if not (sft_dir / "summary.json").exists():
        lgt_train_shown("sft", str(config), "--traces", str(out / "record" / "store"),
                        "--run-dir", str(sft_dir), "--set", f"seed={seed}")
    if not (rl_dir / "summary.json").exists():
        lgt_train_shown("run", str(config), "--checkpoint", str(sft_dir), "--run-dir", str(rl_dir),
                        "--max-minutes", str(rl_minutes), "--set", f"seed={seed}")
    return read_row(path, seed, out)


def read_row(path: str, seed: int, out: Path) -> dict:
    """One seed's figures, read from what its stages wrote."""
    recorded = json.loads((out / "record" / "summary.json").read_text())
    sft = json.loads((out / f"sft-s{seed}" / "summary.json").read_text())
    rl_dir = out / f"rl-s{seed}"
    rl = json.loads((rl_dir / "summary.json").read_text())
    evals = [json.loads(line) for line in (rl_dir / "eval.jsonl").read_text().splitlines() if line.strip()]
    return {"path": path, "seed": seed, "teacher": recorded["splits"]["train"]["reward_mean"],
            "traces": recorded["splits"]["train"]["ok"],
            "base": _point(sft["eval_before"]), "sft": _point(sft["eval_after"]),
            "sft_steps": sft["steps"], "sft_minutes": sft["minutes"],
            "rl_start": _point(rl["eval_before"]), "rl": _point(rl["eval_after"]),
            "rl_steps": rl["steps"], "rl_minutes": rl["minutes"],
            "curve": [(e.get("step"), round(float(e.get("time_s") or 0) / 60, 1),
                       e.get("eval/reward_greedy"), e.get("eval/reward_sampled")) for e in evals]}


def _gain(r: dict) -> list[float | None]:
    """After RL less the RL run's own first evaluation (the warm start), greedy and sampled."""
    return [None if a is None or b is None else a - b for a, b in zip(r["rl"], r["rl_start"])]


def _point(e: dict | None) -> tuple[float | None, float | None]:
    return (None, None) if not e else (e.get("greedy"), e.get("sampled"))


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def table(rows: list[dict]) -> str:
    head = (f"{'path':>11} {'seed':>4} {'base g/s':>11} {'after SFT g/s':>14} {'SFT min':>7} "
            f"{'RL start g/s':>13} {'after RL g/s':>13} {'RL steps':>8} {'RL min':>6} {'RL gain g/s':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        (bg, bs), (sg, ss), (tg, ts), (rg, rs) = r["base"], r["sft"], r["rl_start"], r["rl"]
        gain = _gain(r)
        lines.append(f"{r['path']:>11} {r['seed']:>4} {_f(bg):>5}/{_f(bs):<5} {_f(sg):>7}/{_f(ss):<6} "
                     f"{r['sft_minutes']:>7.1f} {_f(tg):>6}/{_f(ts):<6} {_f(rg):>6}/{_f(rs):<6} "
                     f"{r['rl_steps']:>8} {r['rl_minutes'] or 0:>6.1f} {_f(gain[0]):>6}/{_f(gain[1]):<5}")
    for r in rows:
        lines.append(f"{r['path']} seed {r['seed']}: held-out during RL (step, minute, greedy, sampled): "
                     + ", ".join(f"({s}, {m}, {_f(g)}, {_f(x)})" for s, m, g, x in r["curve"]))
    calc = [r for r in rows if r["path"] == "calc"]
    if calc:  # the agent samples at temperature 1: its success is the sampled one
        ok = sum(1 for r in calc if (_gain(r)[1] or 0) >= 0.2 and (r["rl_minutes"] or 0) <= 30)
        lines.append(f"calc: RL adds ≥ 0.2 to held-out success at the agent's own temperature (sampled) "
                     f"within 30 minutes on {ok} of {len(calc)} seeds")
    for r in rows:
        if r["path"] == "claude_code":
            whole = r["sft_minutes"] + (r["rl_minutes"] or 0)
            lines.append(f"claude_code seed {r['seed']}: {_f(r['base'][0])} → {_f(r['rl'][0])} held-out "
                         f"(greedy) in {whole:.0f} minutes of SFT and RL (goal ≥ 0.80 within 60)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--harness", action="store_true", help="Claude Code instead of the calc agent")
    ap.add_argument("--rl-minutes", type=float, default=30.0, help="the RL's time limit (default 30)")
    ap.add_argument("--out", type=Path, help="a folder to write into, or to go on in (default a new one)")
    ap.add_argument("--report", type=Path, nargs="+", metavar="OUT",
                    help="tabulate the seeds bench runs finished (their folders)")
    args = ap.parse_args()
    if args.report:
        rows = []
        for out in args.report:
            path = json.loads((out / "path.json").read_text())["path"]
            seeds = sorted(int(d.name[4:]) for d in out.glob("rl-s*") if (d / "summary.json").exists())
            rows += [read_row(path, seed, out) for seed in seeds]
        print(table(rows))
        return
    path = "claude_code" if args.harness else "calc"
    out = (args.out or ROOT / "runs" / f"real-model-{path}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "path.json").write_text(json.dumps({"path": path}))
    record(path, out)
    rows = [seed_row(path, int(seed), out, args.rl_minutes) for seed in args.seeds.split(",")]
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
