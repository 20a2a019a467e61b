"""Does every example run as its header says? `lgt-train run <config> --steps 2` for each, one line each.

Each example under examples/ is run the way a user runs it — its own config, its own engine (started by
the run), its agent's own environment, the PATH of scripts/demo.sh — with `--steps 2`, and the bench reads
the time from the start of its engine to its second step (the models the examples build on first use
are built before that and reported apart: the goal is ≤ 10 minutes to the second step on 2 cores, the
model build aside). One example at a time, so each has the machine to itself.

    .venv/bin/python bench/examples.py                          # every example
    .venv/bin/python bench/examples.py --only claude_code,codex # some of them
    .venv/bin/python bench/examples.py --report runs/bench-examples   # the table of finished runs

Per example: the model build (s, when this run built it), engine start → step 1 and → step 2 (s), the
number of calls recorded and how many of them the run's output cap (`proxy.max_output_tokens`) bounded,
and the run's exit code. A run that does not reach step 2 within --limit minutes is stopped and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from lgt.trainer.serving import children

ROOT = Path(__file__).resolve().parents[1]
GOAL_S = 600  # the second step within 10 minutes of the engine's start
ENGINE_LINES = ("starting the vLLM engine", "using the vLLM engine")


def configs() -> list[Path]:
    """Every example a user starts with `lgt-train run`: each run.yaml, and the OPD run beside them
    (examples/distill/sft.yaml and claude_code/distill.yaml are `record` + `sft` walks: bench/distill.py)."""
    return sorted(ROOT.glob("examples/*/run.yaml")) + [ROOT / "examples/distill/opd.yaml"]


def name_of(config: Path) -> str:
    return config.parent.name if config.stem == "run" else f"{config.parent.name}/{config.stem}"


def run_one(config: Path, run_dir: Path, limit_s: float) -> dict:
    """Run ``config`` for 2 steps, timing its lines; stopped after ``limit_s`` past its engine's start."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "lgt.trainer.cli", "run", str(config), "--steps", "2",
           "--run-dir", str(run_dir)]
    print(f"$ lgt-train run {config.relative_to(ROOT)} --steps 2 --run-dir {run_dir}", file=sys.stderr,
          flush=True)
    t0 = time.monotonic()
    marks: dict[str, float] = {}
    log = run_dir.parent / f"{run_dir.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True,
                            start_new_session=True)

    def read() -> None:
        with open(log, "w") as out:
            for line in proc.stdout:  # type: ignore[union-attr]
                out.write(line)
                out.flush()
                now = time.monotonic() - t0
                if "building the" in line:
                    marks.setdefault("build", now)
                if any(s in line for s in ENGINE_LINES):
                    marks.setdefault("engine", now)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    steps: dict[int, float] = {}
    stopped = None
    while proc.poll() is None:
        time.sleep(1)
        now = time.monotonic() - t0
        for step in _steps(run_dir):
            steps.setdefault(step, now)
        if 2 in steps:
            break
        if "engine" in marks and now - marks["engine"] > limit_s:
            stopped = f"no step 2 within {limit_s / 60:.0f} min of the engine's start"
            break
    if proc.poll() is None:
        if 2 in steps:
            try:  # the run ends by itself after its second step (final evaluation, checkpoint, report)
                proc.wait(timeout=limit_s)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            children.stop(proc, 60)  # the run and what it started in its session
    reader.join(timeout=10)
    for step in _steps(run_dir):
        steps.setdefault(step, time.monotonic() - t0)
    engine = marks.get("engine")
    return {"example": name_of(config), "rc": proc.returncode, "stopped": stopped,
            "build_s": (engine - marks["build"]) if engine is not None and "build" in marks else None,
            "step1_s": steps[1] - engine if 1 in steps and engine is not None else None,
            "step2_s": steps[2] - engine if 2 in steps and engine is not None else None,
            **_calls(run_dir), "run_dir": str(run_dir), "log": str(log)}


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            pass  # a line being written
    return out


def _calls(run_dir: Path) -> dict:
    """Calls recorded, those the run's output cap bounded, and the mean generated tokens a call."""
    store = run_dir / "store"
    if not store.exists():
        return {"calls": 0, "capped": 0, "tokens_per_call": None}
    from lgt.store.query import connect

    try:
        con = connect(store)
        n, capped, tokens = con.execute(
            "SELECT count(*), count(*) FILTER (WHERE list_contains(list_transform(translation, "
            "lambda x: x LIKE '%output cap%'), true)), avg(len(response_token_ids)) FROM calls").fetchone()
        con.close()
    except Exception as e:  # noqa: BLE001 - an empty store (no call yet) has no calls view
        return {"calls": 0, "capped": 0, "tokens_per_call": None, "store_error": str(e).splitlines()[0]}
    return {"calls": n, "capped": capped or 0, "tokens_per_call": tokens}


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def table(rows: list[dict]) -> str:
    head = (f"{'example':<22} {'build s':>7} {'→ step 1 s':>10} {'→ step 2 s':>10} {'calls':>6} "
            f"{'capped':>6} {'tok/call':>8} {'rc':>4}  result")
    lines = [head, "-" * len(head)]
    for r in rows:
        ok = r["step2_s"] is not None and r["step2_s"] <= GOAL_S
        result = "ok" if ok else (r["stopped"] or ("step 2 past 10 min" if r["step2_s"] else "no step 2"))
        lines.append(f"{r['example']:<22} {_s(r['build_s']):>7} {_s(r['step1_s']):>10} "
                     f"{_s(r['step2_s']):>10} {r['calls']:>6} {r['capped']:>6} "
                     f"{_s(r['tokens_per_call']):>8} {r['rc']!s:>4}  {result}")
    ok = [r for r in rows if r["step2_s"] is not None and r["step2_s"] <= GOAL_S]
    lines.append(f"{len(ok)} of {len(rows)} examples reached step 2 within {GOAL_S // 60} minutes of their "
                 "engine's start" + (f"; slowest {max(r['step2_s'] for r in ok):.0f} s" if ok else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated example names (e.g. claude_code,distill/opd)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-examples")
    ap.add_argument("--limit", type=float, default=15, help="minutes past the engine's start before a run "
                    "is stopped")
    ap.add_argument("--report", type=Path, help="print the table of a finished bench's results.jsonl")
    args = ap.parse_args()
    if args.report:
        rows = [json.loads(x) for x in (args.report / "results.jsonl").read_text().splitlines() if x]
        rows = [{**r, **_calls(Path(r["run_dir"]))} if r.get("run_dir") else r for r in rows]
        print(table(rows))
        return
    chosen = configs()
    if args.only:
        want = set(args.only.split(","))
        unknown = want - {name_of(c) for c in chosen}
        if unknown:
            known = ", ".join(name_of(c) for c in chosen)
            sys.exit(f"no example named {sorted(unknown)[0]!r} (known: {known})")
        chosen = [c for c in chosen if name_of(c) in want]
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for config in chosen:
        run_dir = args.out / f"{name_of(config).replace('/', '-')}-{stamp}"
        r = run_one(config, run_dir, args.limit * 60)
        rows.append(r)
        with open(args.out / "results.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")
        print(table([r]).splitlines()[2], file=sys.stderr, flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
