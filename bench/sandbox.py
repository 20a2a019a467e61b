"""What the sandbox costs: a rollout's start with and without it, and the demo's time to target.

    .venv/bin/python bench/sandbox.py --start              # per-rollout cost, side by side (~1 min)
    .venv/bin/python bench/sandbox.py --demo               # the demo twice: agent.sandbox none vs bwrap

``--start``: the rollout controller runs tiny agents one after another through a real lgt-proxy (on a
fake upstream), alternating ``agent.sandbox: none`` and ``bwrap``, and compares each attempt's wall
time (start, run, exit, reward): a shell agent that prints its reward (a fresh process each time) and a
Python agent forked warm (``python_preload``, as the demo's). The difference of the medians is the cost
the sandbox adds to a rollout (goal: ≤ 10 ms).

``--demo``: ``lgt-train run examples/carry/run.yaml`` with the sandbox off, then on (same seed), and the
ratio of their seconds to the target (goal: ≤ 1.05; one run each, so noise of a few per cent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY_AGENT = "import sys; print(1)\n"


async def timings(agent, proxy, store: Path, run_dir: Path, n: int) -> list[float]:
    from lgt.trainer.rollout.controller import RolloutController

    ctl = RolloutController(agent, proxy, store, run_dir, 1, batch_records=True)
    out = []
    try:
        for i in range(n + 3):
            r = await ctl.run({"task_id": f"t{i}"}, f"b{i}")
            if r.status != "ok":
                raise SystemExit(f"bench agent failed: {r.error}")
            if i >= 3:  # the first ones start the zygote and warm the caches
                out.append(r.seconds * 1000)
    finally:
        await ctl.aclose()
    return out


def start_cost(n: int) -> None:
    from lgt.testing.fake_upstream import FakeUpstream
    from lgt.trainer.rollout.agent import AgentSpec
    from lgt.trainer.serving.proxy import ProxyClient

    with tempfile.TemporaryDirectory(prefix="lgt-sandbox-") as d, FakeUpstream.in_thread(port=0) as up:
        tmp = Path(d)
        os.chmod(tmp, 0o755)
        (tmp / "agent.py").write_text(PY_AGENT)
        store = tmp / "store"
        proxy = ProxyClient.start(store, up.url, log_path=tmp / "proxy.log")
        try:
            agents = {
                "shell agent (a fresh process)": dict(command=("sh", "-c", "echo 1")),
                "Python agent (forked warm)": dict(command=(sys.executable, "agent.py"),
                                                   python_preload=("json",)),
            }
            for name, kw in agents.items():
                got: dict[str, list[float]] = {"none": [], "bwrap": []}
                for rnd in range(4):  # alternate, so drift on a noisy machine hits both alike
                    for kind in ("none", "bwrap"):
                        agent = AgentSpec(cwd=tmp, timeout_s=30, retries=0, sandbox=kind,
                                          reward_sources=("stdout",), **kw)
                        got[kind] += asyncio.run(timings(agent, proxy, store, tmp / f"run-{kind}-{rnd}",
                                                         n // 4))
                off, on = statistics.median(got["none"]), statistics.median(got["bwrap"])
                print(f"{name:32s} median per rollout: none {off:6.1f} ms   bwrap {on:6.1f} ms   "
                      f"added {on - off:+6.1f} ms   ratio {on / off:.2f}  ({len(got['none'])} each)")
        finally:
            proxy.stop()


def demo(seed: int) -> None:
    rows = {}
    for kind in ("none", "bwrap"):
        run_dir = ROOT / "runs" / f"bench-sandbox-{kind}-{os.getpid()}"
        cmd = [sys.executable, "-m", "lgt.trainer.cli", "run", str(ROOT / "examples/carry/run.yaml"),
               "--run-dir", str(run_dir), "--set", f"seed={seed}", "--set", f"agent.sandbox={kind}"]
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        print(f"$ {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, env=env)
        rows[kind] = json.loads((run_dir / "summary.json").read_text())
    for kind, s in rows.items():
        print(f"sandbox {kind:5s}: target {'reached' if s['reached'] else 'MISSED'} at step "
              f"{s['steps_to_target']} in {s['seconds_to_target'] or float('nan'):.0f} s of training "
              f"({s['steps']} steps, {s['minutes']:.1f} min)")
    off, on = rows["none"]["seconds_to_target"], rows["bwrap"]["seconds_to_target"]
    if off and on:
        print(f"time to target, bwrap / none: {on / off:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--start", action="store_true", help="the per-rollout cost")
    ap.add_argument("--demo", action="store_true", help="the demo with the sandbox off, then on")
    ap.add_argument("--n", type=int, default=80, help="rollouts per agent and setting (--start)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not (args.start or args.demo):
        args.start = True
    if args.start:
        start_cost(args.n)
    if args.demo:
        demo(args.seed)


if __name__ == "__main__":
    main()
