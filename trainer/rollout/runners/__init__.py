"""Where a rollout attempt runs: the runners behind one small protocol (:mod:`.base`), and their registry.

``agent.runner`` names one of :data:`RUNNERS`: ``local`` (a process of this machine, in a sandbox of its
own unless ``agent.sandbox: none``) or ``kubernetes`` (a Job). A new runner is a file here with a class
that has the verbs of :class:`~.base.Runner` and a ``check(agent, environ)`` static method, and an entry
in :data:`RUNNERS` (and its name in :data:`lgt.trainer.rollout.agent.RUNNER_NAMES`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from lgt.trainer.rollout.agent import RUNNER_NAMES, AgentSpec
from lgt.trainer.rollout.runners.base import Runner
from lgt.trainer.rollout.runners.kubernetes import KubernetesRunner
from lgt.trainer.rollout.runners.local import LocalRunner
from lgt.trainer.rollout.runners.sandboxed import SandboxedRunner


def _local(agent: AgentSpec) -> type[LocalRunner]:
    return SandboxedRunner if agent.sandbox.on else LocalRunner


# agent.runner → the runner's class for that agent
RUNNERS: dict[str, Callable[[AgentSpec], type]] = {
    "local": _local,
    "kubernetes": lambda agent: KubernetesRunner,
}
assert tuple(RUNNERS) == RUNNER_NAMES


def runner_class(agent: AgentSpec) -> type:
    return RUNNERS[agent.runner](agent)


def make_runner(agent: AgentSpec, *, run_dir: Path, kill_grace_s: float = 5.0,
                hidden: Sequence[Path] = ()) -> Runner:
    """The agent's runner for a controller whose run directory is ``run_dir``; ``hidden``: what no
    attempt may see (sandboxed)."""
    return runner_class(agent)(agent, run_dir=run_dir, kill_grace_s=kill_grace_s, hidden=hidden)


def check_agent(agent: AgentSpec, environ: Mapping[str, str] | None = None) -> None:
    """Refuse an agent spec that cannot start: missing cwd, command or evaluator not found or not
    executable, an ``env`` value naming a variable no rollout has, an unusable Job template or sandbox.
    Starts nothing."""
    runner_class(agent).check(agent, os.environ if environ is None else environ)
