"""``lgt-train eval``: one held-out evaluation (:class:`~lgt.trainer.run.evaluation.Evaluator`) of a
checkpoint or of the config's model, served as a run serves it (:class:`~lgt.trainer.policy.Policy`)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from lgt.trainer.config import RunConfig
from lgt.trainer.policy import Policy
from lgt.trainer.preflight import Tasks
from lgt.trainer.run import evaluation
from lgt.trainer.run.runlog import Display


def evaluate(cfg: RunConfig, tasks: Tasks, *, checkpoint: Path | None = None,
             policies: dict[str, Path] | None = None, run_dir: Path | None = None,
             display: Display | None = None) -> tuple[Path, evaluation.EvalResult]:
    """One held-out evaluation of ``checkpoint`` (a run's ``checkpoints/step-N``) or, without one, of
    the config's model (``policies``: a run of several policies' checkpoints of one step, each served as
    the run served it), on ``tasks`` (:func:`lgt.trainer.preflight.validate_eval` checked and read them);
    eval.jsonl and the store's eval rollouts in ``run_dir``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = (run_dir or Path.cwd() / "runs" / f"{cfg.name}-eval-{stamp}").resolve()
    policy = Policy(cfg, tasks, run_dir, display=display)
    try:
        if policies:
            policy.serve_policy_checkpoints(policies)
        else:
            policy.serve_checkpoint(checkpoint)
        evaluator = evaluation.Evaluator(cfg.eval, policy.eval_tasks, policy.controller.run, run_dir,
                                         log=policy.runlog.log, elapsed=policy.runlog.elapsed)

        async def once() -> evaluation.EvalResult:
            policy.runlog.restart_clock()
            try:
                return await evaluator.once(policy.progress.step, policy.progress.version)
            finally:
                await policy.close_rollouts()

        return run_dir, asyncio.run(once())
    finally:
        policy.stop()
