"""What the sandbox costs: a rollout's start with and without it, and the demo's time to target.

    .venv/bin/python bench/sandbox.py --start              # per-rollout cost, side by side (~1 min)
    .venv/bin/python bench/sandbox.py --cpu                # the machine's CPU per rollout, side by side
    .venv/bin/python bench/sandbox.py --demo               # the demo twice: agent.sandbox none vs bwrap

``--start``: the rollout controller runs tiny agents one after another through a real lgt-proxy (on a
fake upstream), alternating ``agent.sandbox: none`` and ``bwrap``, and compares each attempt's wall
time (start, run, exit, reward): a shell agent that prints its reward (a fresh process each time) and a
Python agent forked warm (``python_preload``, as the demo's). The difference of the medians is the cost
the sandbox adds to a rollout (goal: ≤ 10 ms).

``--cpu``: what a rollout costs the machine where rollouts compete for its cores (a CPU-bound async
run): examples/arith's agent (the OpenAI SDK over HTTPS through the proxy, forked warm) run 2 × ``--n``
times, ``--concurrency`` at once, and the machine's busy CPU time (``/proc/stat``: every process and
the kernel) per rollout, alternating ``none`` and ``bwrap`` for ``--rounds`` rounds; the medians, the
CPU the sandbox adds and the ratio.

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
ARITH_AGENT = ROOT / "examples" / "arith" / "agent.py"  # the OpenAI SDK over HTTPS, through the proxy


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


def busy_seconds() -> float:
    """The machine's busy CPU seconds since boot, all cores (``/proc/stat``: user to steal)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


async def cpu_per_rollout(agent, proxy, store: Path, run_dir: Path, n: int, concurrency: int) -> float:
    from lgt.trainer.rollout.controller import RolloutController

    task = {"question": "What is 3+4?", "answer": "7"}
    ctl = RolloutController(agent, proxy, store, run_dir, concurrency, batch_records=True)
    try:
        await asyncio.gather(*(ctl.run(task, f"w{i}") for i in range(4)))  # the zygote started and warm
        before = busy_seconds()
        results = await asyncio.gather(*(ctl.run(task, f"b{i}") for i in range(n)))
        used = busy_seconds() - before
    finally:
        await ctl.aclose()
    failed = [r.error for r in results if r.status != "ok"]
    if failed:
        raise SystemExit(f"bench agent failed: {failed[0]}")
    return used * 1000 / n


def cpu_cost(n: int, concurrency: int, rounds: int) -> None:
    from lgt.testing.fake_upstream import FakeUpstream
    from lgt.trainer.rollout.agent import AgentSpec
    from lgt.trainer.serving.proxy import ProxyClient

    env = {"OPENAI_BASE_URL": "https://api.openai.invalid/v1", "OPENAI_API_KEY": "sk-bench"}
    with tempfile.TemporaryDirectory(prefix="lgt-sandbox-") as d, FakeUpstream.in_thread(port=0) as up:
        tmp = Path(d)
        os.chmod(tmp, 0o755)
        store = tmp / "store"
        proxy = ProxyClient.start(store, up.url, log_path=tmp / "proxy.log")
        try:
            got: dict[str, list[float]] = {"none": [], "bwrap": []}
            for rnd in range(rounds):  # alternate, so drift on a noisy machine hits both alike
                for kind in got:
                    agent = AgentSpec(command=(sys.executable, str(ARITH_AGENT)), env=env, sandbox=kind,
                                      python_preload=("auto",), timeout_s=60, retries=0)
                    ms = asyncio.run(cpu_per_rollout(agent, proxy, store, tmp / f"run-{kind}-{rnd}", n,
                                                     concurrency))
                    got[kind].append(ms)
                    print(f"  round {rnd} {kind:5s}: {ms:5.1f} ms of CPU per rollout", flush=True)
        finally:
            proxy.stop()
    off, on = statistics.median(got["none"]), statistics.median(got["bwrap"])
    print(f"CPU per rollout (median of {rounds}, {n} rollouts, {concurrency} at once): none {off:.1f} ms   "
          f"bwrap {on:.1f} ms   added {on - off:+.1f} ms   ratio {on / off:.2f}")


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
    ap.add_argument("--cpu", action="store_true", help="the machine's CPU per rollout, none vs bwrap")
    ap.add_argument("--demo", action="store_true", help="the demo with the sandbox off, then on")
    ap.add_argument("--n", type=int, default=80,
                    help="rollouts per agent and setting (--start; --cpu runs twice as many)")
    ap.add_argument("--concurrency", type=int, default=32, help="rollouts at once (--cpu)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of none then bwrap (--cpu)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not (args.start or args.cpu or args.demo):
        args.start = True
    if args.start:
        start_cost(args.n)
    if args.cpu:
        cpu_cost(args.n * 2, args.concurrency, args.rounds)
    if args.demo:
        demo(args.seed)


if __name__ == "__main__":
    main()
