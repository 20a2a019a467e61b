"""Prompt optimisation, beam vs gepa, on the same task and budget in one run: rollouts and critic calls
each spends to reach the target reward.

    .venv/bin/python bench/apo.py                          # the scripted task and critic (loopback)
    .venv/bin/python bench/apo.py --critic-base-url http://gpu-box:8000/v1 --critic-model Qwen3-8B

The task: the agent (tests/trainer/agents/prompt_agent.py) is given its prompt as a resource and earns
reward 1 only when the prompt says "Answer in one word." and keeps the task's question; it starts from
"Solve {question}." (reward 0). Rollouts are real: each runs the agent through lgt-proxy (a fake engine
on loopback answers its model call). The critic is testing/scripted_critic.py — deterministic
rewrites, among them an empty answer, a lost placeholder and a timeout — unless --critic-base-url names
a real model, which then has to find the instruction itself from the traces and rewards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path


def spent(run_dir: Path, target: float) -> tuple[int, float | None]:
    """Rollouts run until the first validation score at or above ``target`` (all of them if none), and
    the best validation reward."""
    from lgt.trainer.apo.optimize import Ledger

    n, reached, best = 0, None, None
    for r in Ledger(run_dir).rows:
        if r["event"] != "score":
            continue
        n += r["n"]
        if r["split"] == "val":
            best = r["reward"] if best is None else max(best, r["reward"])
            if reached is None and r["reward"] >= target:
                reached = n
    return (reached if reached is not None else n), best


async def one(optimizer: str, args: argparse.Namespace, store: Path, proxy, critic_url: str,
              tmp: Path) -> dict:
    from lgt.testing.rollouts import AGENTS
    from lgt.testing.scripted_critic import SEED
    from lgt.trainer.apo import optimize as apo
    from lgt.trainer.rollout.agent import AgentSpec
    from lgt.trainer.rollout.controller import RolloutController
    from lgt.trainer.rollout.resources import Resources, ResourceSpec

    (tmp / "prompt.txt").write_text(SEED)
    start = Resources({"system_prompt": ResourceSpec(tmp / "prompt.txt", "env")})
    agent = AgentSpec(command=(sys.executable, str(AGENTS / "prompt_agent.py")),
                      timeout_s=60, retries=0)
    ctl = RolloutController(agent, proxy, store, tmp / optimizer, 16, batch_records=True)
    cfg = apo.ApoConfig(optimizer=optimizer, rounds=args.rounds, beam_width=2, branch_factor=2,
                        batch_size=args.batch, val_size=args.val, target_reward=1.0, max_rollouts=args.budget,
                        critic=apo.CriticConfig(model=args.critic_model, timeout_s=args.critic_timeout,
                                                api_key_env=args.critic_api_key_env))
    critic = apo.Critic(cfg.critic, critic_url)
    train = [{"task_id": f"t{i}", "question": f"What is {i} plus {i}?"} for i in range(12)]
    val = [{"task_id": f"v{i}", "question": f"What is {i} times {i}?"} for i in range(args.val)]
    t0 = time.monotonic()
    try:
        best = await apo.optimize(cfg, start, apo.make_runner(ctl, store), train, val, critic,
                                  tmp / optimizer, log=lambda _: None)
    finally:
        await ctl.aclose()
    rollouts, top = spent(tmp / optimizer, 1.0)
    return {"optimizer": optimizer, "reached": (top or 0) >= 1.0, "rollouts": rollouts,
            "critic_calls": critic.calls, "unusable": critic.failures, "best_val": top,
            "seconds": time.monotonic() - t0, "best": best["text"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--critic-base-url", help="a real critic (OpenAI-compatible /v1); default: scripted")
    ap.add_argument("--critic-model", default="policy")
    ap.add_argument("--critic-api-key-env")
    ap.add_argument("--critic-timeout", type=float, default=0.5, help="seconds (a real model needs more)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="training tasks per critique / GEPA minibatch")
    ap.add_argument("--val", type=int, default=4)
    ap.add_argument("--budget", type=int, default=200, help="rollouts each optimiser may spend")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from lgt.testing.fake_upstream import FakeUpstream
    from lgt.testing.scripted_critic import ScriptedCritic
    from lgt.trainer.serving.proxy import ProxyClient

    out = []
    with tempfile.TemporaryDirectory(prefix="lgt-apo-") as d, FakeUpstream.in_thread(port=0) as up:
        tmp = Path(d)
        for optimizer in ("beam", "gepa"):
            store = tmp / f"store-{optimizer}"
            proxy = ProxyClient.start(store, up.url, log_path=tmp / f"proxy-{optimizer}.log")
            try:
                with (contextlib.nullcontext(args.critic_base_url) if args.critic_base_url
                      else ScriptedCritic()) as url:
                    out.append(asyncio.run(one(optimizer, args, store, proxy, url, tmp)))
            finally:
                proxy.stop()
    if args.json:
        print(json.dumps(out, indent=2))
    for r in out:
        status = "reached" if r["reached"] else "MISSED "
        print(f"{r['optimizer']:5s} target {status} after {r['rollouts']:4d} "
              f"rollouts, {r['critic_calls']:3d} critic calls ({r['unusable']} unusable), best validation "
              f"{r['best_val']:.2f}, {r['seconds']:.0f} s")
    b, g = out
    if b["reached"] and g["reached"]:
        print(f"gepa / beam: rollouts {g['rollouts'] / b['rollouts']:.2f}x, critic calls "
              f"{g['critic_calls'] / max(b['critic_calls'], 1):.2f}x")
    return 0 if all(r["reached"] for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
