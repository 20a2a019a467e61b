"""Learning from a stronger model before RL, on the CPU demo: RL alone, SFT then RL, OPD, OPD then RL.

    .venv/bin/python bench/distill.py --seeds 0,1,2                    # every arm, three seeds
    .venv/bin/python bench/distill.py --seeds 0 --arms rl,opd          # some of them
    .venv/bin/python bench/distill.py --report runs/distill-*          # the table of finished arms
    .venv/bin/python bench/distill.py --harness --seeds 0,1,2          # Claude Code: record, SFT, eval

Every arm starts from the same warm start (examples/carry: the model forgets the carry on most
problems) and stops at the same target (the mean training reward of 10 steps ≥ 0.9) or limits:

- ``rl``: ``lgt-train run examples/carry/run.yaml``;
- ``rl-same-updates``: the same, with the OPD example's optimizer updates per step
  (``backend.updates_per_step`` x ``backend.epochs``): whether the updates, not the teacher, do the work;
- ``opd``: ``lgt-train run examples/distill/opd.yaml --set teacher.top_k=0`` — the teacher (the same
  warm start trained on right answers, built by ``teacher.make``) scores every token the student
  generates: the sampled log-ratio only (with the example's 16 updates a batch, which it does not bear:
  docs/distill.md);
- ``opd-top8``: the example as it is, with the teacher's top 8 tokens at every generated position in
  the loss (``teacher.top_k: 8``) beside the sampled log-ratio, 16 optimizer updates a batch;
- ``opd+rl``: ``--distill-steps`` steps of ``opd-top8``, then RL from its checkpoint;
- ``sft+rl``: the teacher, served by ``lgt-train engine`` as if it were a hosted model, answers the
  unchanged agent on the training tasks (``lgt-train record``), ``lgt-train sft`` trains the student on
  the traces that earned reward 1, then RL from that checkpoint.

``--harness`` measures the harness path instead (examples/claude_code/distill.yaml): Claude Code, unchanged,
recorded on a stand-in hosted model (``python -m lgt.testing.hosted_teacher``: Anthropic Messages on
loopback, an expert at the write-a-word task), then the demo model SFT-trained on the rewarded traces and
run in Claude Code itself: the teacher's success, the SFT's steps and seconds, and the student's held-out
task success before → after, per seed.

Steps and seconds to the target count every stage (the SFT's optimizer steps and seconds, the OPD steps);
teacher calls are the teacher's requests (OPD) or recorded calls (SFT). Held-out greedy and sampled
reward (the config's ``eval``: tasks never trained on) before the first stage → after the last. The last
lines give each arm's steps to target over RL's, per seed (goal: OPD ≤ 1/3 on 3 of 3 seeds, with held-out
reward at least as high).
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
CARRY = ROOT / "examples" / "carry" / "run.yaml"
OPD = ROOT / "examples" / "distill" / "opd.yaml"
SFT = ROOT / "examples" / "distill" / "sft.yaml"
HARNESS = ROOT / "examples" / "claude_code" / "distill.yaml"
ARMS = ("rl", "rl-same-updates", "sft+rl", "opd", "opd-top8", "opd+rl")



def run(config: Path, run_dir: Path, seed: int, *sets: str) -> dict:
    lgt_train_shown("run", str(config), "--run-dir", str(run_dir), "--set", f"seed={seed}",
                    *(x for s in sets for x in ("--set", s)))
    return json.loads((run_dir / "summary.json").read_text())


def final_checkpoint(run_dir: Path) -> Path:
    from lgt.trainer.backends.checkpoints import latest_checkpoint

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise SystemExit(f"{run_dir} has no finished checkpoint")
    return ckpt


def from_checkpoint(ckpt: Path) -> tuple[str, str]:
    return f"model.path={ckpt}", "model.make=null"


def opd_updates() -> tuple[str, str]:
    """The OPD example's optimizer updates per step, as ``--set`` overrides for another config."""
    from lgt.trainer import config as cfgmod

    b = cfgmod.load(OPD).backend
    return f"backend.updates_per_step={b.updates_per_step}", f"backend.epochs={b.epochs}"


def teacher_dir() -> Path:
    """The teacher examples/distill/opd.yaml names (built by its teacher.make when missing)."""
    from lgt.trainer import config as cfgmod

    cfg = cfgmod.load(OPD)
    assert cfg.teacher is not None and cfg.teacher.path is not None
    if not cfg.teacher.path.exists():
        from lgt.trainer.demo.factory import make_model

        m = cfg.teacher.make
        make_model(cfg.teacher.path, preset=m.preset, warm_start_task=m.warm_start, steps=m.steps,
                   seconds=m.seconds, seed=m.seed, correct_fraction=m.correct_fraction)
    return cfg.teacher.path


class HostedTeacher:
    """The teacher behind ``lgt-train engine``: a local stand-in for a hosted model (its URL is what the
    agent's OPENAI_BASE_URL names while its traces are recorded)."""

    def __init__(self, model: Path, port: int = 8031) -> None:
        self.url = f"http://127.0.0.1:{port}/v1"
        cmd = [sys.executable, "-m", "lgt.trainer.cli", "engine", str(model), "--port", str(port),
               "--max-model-len", "256", "--served-model-name", "gpt-4o-mini"]  # what the agent asks for
        self.proc = subprocess.Popen(cmd, env=trainer_env(), start_new_session=True)

    def wait(self, timeout: float = 600) -> None:
        import httpx

        def up() -> bool:
            try:
                return httpx.get(self.url + "/models", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        if children.wait_until(up, self.proc, timeout, every=2):
            return
        if self.proc.returncode is not None:
            raise SystemExit("the teacher's engine exited")
        raise SystemExit("the teacher's engine did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            children.stop(self.proc, 60)  # lgt-train engine, which stops its vLLM


def arm(name: str, seed: int, out: Path, distill_steps: int) -> dict:
    """One arm from the warm start: its stages' summaries, added up."""
    d = out / f"{name.replace('+', '-')}-s{seed}"
    if name == "rl":
        return row(name, seed, [run(CARRY, d / "rl", seed)])
    if name == "rl-same-updates":
        return row(name, seed, [run(CARRY, d / "rl", seed, *opd_updates())])
    if name == "opd":
        # the sampled log-ratio alone does not bear the example's 16 updates a batch (docs/distill.md)
        return row(name, seed, [run(OPD, d / "opd", seed, "teacher.top_k=0", "backend.updates_per_step=1",
                                    "backend.epochs=1")])
    if name == "opd-top8":
        return row(name, seed, [run(OPD, d / "opd", seed, "teacher.top_k=8")])
    if name == "opd+rl":
        first = run(OPD, d / "opd", seed, f"steps={distill_steps}", "target_reward=null", "teacher.top_k=8")
        then = run(CARRY, d / "rl", seed, *from_checkpoint(final_checkpoint(d / "opd")))
        return row(name, seed, [first, then])
    if name == "sft+rl":
        teacher = HostedTeacher(teacher_dir())
        try:
            teacher.wait()
            lgt_train_shown("record", str(SFT), "--run-dir", str(d / "record"), "--set", f"seed={seed}",
                            "--set", f"agent.env.OPENAI_BASE_URL={teacher.url}")
        finally:
            teacher.stop()
        recorded = json.loads((d / "record" / "summary.json").read_text())
        lgt_train_shown("sft", str(SFT), "--traces", str(d / "record" / "store"), "--run-dir", str(d / "sft"),
                        "--set", f"seed={seed}")
        sft = json.loads((d / "sft" / "summary.json").read_text())
        then = run(CARRY, d / "rl", seed, *from_checkpoint(Path(sft["checkpoint"])))
        return row(name, seed, [sft, then], teacher_calls=recorded.get("calls"))
    raise SystemExit(f"unknown arm {name!r}: one of {', '.join(ARMS)}")


def harness(seed: int, out: Path, port: int = 8032) -> dict:
    """The harness path for one seed: record Claude Code on the stand-in hosted model, SFT, evaluate."""
    d = out / f"harness-s{seed}"
    teacher = subprocess.Popen([sys.executable, "-m", "lgt.testing.hosted_teacher", "--port", str(port)],
                               env=trainer_env(), start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        if "a stand-in hosted model" not in (teacher.stdout.readline() if teacher.stdout else ""):
            raise SystemExit(f"the stand-in hosted model did not start on port {port}")  # it says when up
        lgt_train_shown("record", str(HARNESS), "--eval", "--run-dir", str(d / "record"),
                        "--set", f"seed={seed}", "--set", f"agent.env.ANTHROPIC_BASE_URL=http://127.0.0.1:{port}")
    finally:
        children.stop(teacher, 30)
    recorded = json.loads((d / "record" / "summary.json").read_text())
    lgt_train_shown("sft", str(HARNESS), "--traces", str(d / "record" / "store"), "--run-dir", str(d / "sft"),
                    "--set", f"seed={seed}")
    sft = json.loads((d / "sft" / "summary.json").read_text())
    b, a = sft["eval_before"], sft["eval_after"]
    return {"arm": "harness", "seed": seed, "teacher_train": recorded["splits"]["train"]["reward_mean"],
            "teacher_eval": recorded["splits"]["eval"]["reward_mean"], "teacher_calls": recorded["calls"],
            "record_seconds": recorded["seconds"], "samples": sft["samples"], "sft_steps": sft["steps"],
            "sft_seconds": 60 * sft["minutes"], "nll": (sft["nll_first"], sft["nll_last"]),
            "greedy": (b["greedy"], a["greedy"]), "sampled": (b["sampled"], a["sampled"])}


def harness_table(rows: list[dict]) -> str:
    head = (f"{'seed':>4} {'teacher train/held-out':>23} {'calls':>6} {'samples':>7} {'SFT steps':>9} "
            f"{'SFT s':>6} {'NLL':>15} {'student greedy':>15} {'student sampled':>16}")
    lines = [head, "-" * len(head)]
    for r in rows:
        g, s, nll = r["greedy"], r["sampled"], r["nll"]
        lines.append(f"{r['seed']:>4} {_f(r['teacher_train']):>14} / {_f(r['teacher_eval']):<6} "
                     f"{r['teacher_calls']:>6} {r['samples']:>7} {r['sft_steps']:>9} "
                     f"{r['sft_seconds']:>6.0f} "
                     f"{_f(nll[0], '.3f'):>6} → {_f(nll[1], '.3f'):<6} {_f(g[0]):>6} → {_f(g[1]):<6} "
                     f"{_f(s[0]):>7} → {_f(s[1]):<6}")
    return "\n".join(lines)


def row(name: str, seed: int, stages: list[dict], teacher_calls: int | None = None) -> dict:
    """Steps and seconds to the target over all stages (None when the last did not reach it), teacher
    calls, held-out reward before the first stage → after the last."""
    last = stages[-1]
    before = (stages[0].get("eval_before") or {})
    after = (last.get("eval_after") or {})
    earlier_steps = sum(int(s.get("steps") or 0) for s in stages[:-1])
    earlier_s = sum(60 * float(s.get("minutes") or 0) for s in stages[:-1])
    reached = last.get("steps_to_target") is not None
    calls = teacher_calls if teacher_calls is not None else sum(
        int((s.get("teacher") or {}).get("requests") or 0) for s in stages)
    return {"arm": name, "seed": seed,
            "steps": earlier_steps + last["steps_to_target"] if reached else None,
            "seconds": earlier_s + last["seconds_to_target"] if reached else None,
            "teacher_calls": calls,
            "greedy": (before.get("greedy"), after.get("greedy")),
            "sampled": (before.get("sampled"), after.get("sampled"))}


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "—" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    head = (f"{'arm':>15} {'seed':>4} {'steps to target':>16} {'seconds':>8} {'teacher calls':>14} "
            f"{'held-out greedy':>16} {'held-out sampled':>17}")
    lines = [head, "-" * len(head)]
    for r in rows:
        g, s = r["greedy"], r["sampled"]
        steps = "not reached" if r["steps"] is None else str(r["steps"])
        lines.append(f"{r['arm']:>15} {r['seed']:>4} {steps:>16} "
                     f"{_f(r['seconds'], '.0f'):>8} {r['teacher_calls']:>14} "
                     f"{_f(g[0]):>7} → {_f(g[1]):<6} {_f(s[0]):>8} → {_f(s[1]):<6}")
    from lgt.trainer.run.stopping import TARGET_WINDOW

    rl = {r["seed"]: r for r in rows if r["arm"] == "rl"}
    if rl:
        lines.append(f"(the target is the mean training reward of {TARGET_WINDOW} steps: no run reaches it "
                     f"before step {TARGET_WINDOW})")
    for what in ("steps", "seconds"):
        for name in ARMS[1:]:
            ratios = []
            for r in rows:
                base = rl.get(r["seed"])
                if r["arm"] == name and base and base[what] and r[what] is not None:
                    ratios.append((r["seed"], r[what] / base[what]))
            if ratios:
                within = sum(1 for _, x in ratios if x <= 1 / 3)
                lines.append(f"{name}: {what} to target / RL's: "
                             + ", ".join(f"seed {s} {x:.2f}" for s, x in ratios)
                             + f"  (≤ 1/3 on {within} of {len(ratios)})")

    def after(r: dict) -> str:
        return f"{_f(r['greedy'][1])}/{_f(r['sampled'][1])}"

    def as_high(r: dict, base: dict) -> bool:
        return all(r[k][1] is not None and base[k][1] is not None and r[k][1] >= base[k][1]
                   for k in ("greedy", "sampled"))

    for name in ARMS[1:]:
        pairs = [(r, rl[r["seed"]]) for r in rows if r["arm"] == name and r["seed"] in rl]
        if pairs:
            lines.append(f"{name}: held-out greedy/sampled after, against RL's: "
                         + ", ".join(f"seed {r['seed']} {after(r)} vs {after(b)}" for r, b in pairs)
                         + f"  (at least as high on {sum(as_high(r, b) for r, b in pairs)} of {len(pairs)})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--distill-steps", type=int, default=10, help="OPD steps before RL in opd+rl")
    ap.add_argument("--report", type=Path, metavar="OUT", help="tabulate the rows a bench run wrote")
    ap.add_argument("--harness", action="store_true",
                    help="the harness path (Claude Code) instead of the arms")
    args = ap.parse_args()
    if args.report:
        rows = [json.loads(line) for line in (args.report / "rows.jsonl").read_text().splitlines()]
        arms = [r for r in rows if r["arm"] != "harness"]
        runs = [r for r in rows if r["arm"] == "harness"]
        print("\n\n".join(([table(arms)] if arms else []) + ([harness_table(runs)] if runs else [])))
        return
    out = ROOT / "runs" / f"distill-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in ["harness"] if args.harness else args.arms.split(","):
            r = harness(seed, out) if args.harness else arm(name.strip(), seed, out, args.distill_steps)
            rows.append(r)
            with (out / "rows.jsonl").open("a") as f:
                f.write(json.dumps(r) + "\n")
    print()
    print(harness_table(rows) if args.harness else table(rows))


if __name__ == "__main__":
    main()
