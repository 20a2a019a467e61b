"""``lgt-train apo``: the run's ``apo.resource`` optimised with real rollouts (:mod:`~.apo.optimize`) on
the policy served as a run serves it (:class:`~lgt.trainer.policy.Policy`)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from lgt.trainer.apo import optimize as apo
from lgt.trainer.config import RunConfig
from lgt.trainer.policy import Policy
from lgt.trainer.preflight import Tasks
from lgt.trainer.run.runlog import Display


def optimize_prompt(cfg: RunConfig, tasks: Tasks, *, run_dir: Path | None = None, resume: bool = False,
                    checkpoint: Path | None = None,
                    display: Display | None = None) -> tuple[Path, dict[str, Any]]:
    """The search on the config's model or ``checkpoint`` (an RL run's checkpoints/step-N), over
    ``tasks`` (:func:`lgt.trainer.preflight.validate_apo` checked and read them); the best candidate,
    and the run directory (``apo/`` in it)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = (run_dir or Path.cwd() / "runs" / f"{cfg.name}-apo-{stamp}").resolve()
    policy = Policy(cfg, tasks, run_dir, resume=resume, display=display)
    try:
        policy.serve_checkpoint(checkpoint)
        train = list(policy.tasks)
        val = list(policy.eval_tasks)[:cfg.apo.val_size] or train[-cfg.apo.val_size:]
        if not policy.eval_tasks:  # no held-out split: the last val_size tasks validate, the rest train
            train = train[:-cfg.apo.val_size] or train
        critic = apo.Critic(cfg.apo.critic, f"{policy.supervisor.engine.url}", cfg.engine.served_model_name)
        run = apo.make_runner(policy.controller, policy.store, cfg.apo.samples)

        async def go() -> dict[str, Any]:
            try:
                return await apo.optimize(cfg.apo, policy.controller.resources, run, train, val, critic,
                                          run_dir, log=policy.runlog.log)
            finally:
                await policy.close_rollouts()

        best = asyncio.run(go())
        apo.plot(run_dir)
        apo.write_report(run_dir)
        return run_dir, {**best, "critic_calls": critic.calls, "critic_failures": critic.failures}
    finally:
        policy.stop()
