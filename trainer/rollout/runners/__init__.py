"""Where a rollout attempt runs: the runners behind one small protocol (:mod:`.base`).

``agent.runner`` names an entry of :data:`lgt.trainer.rollout.agent.RUNNERS`: ``local`` (a process of
this machine, in a sandbox of its own unless ``agent.sandbox: none``: :mod:`.local`, :mod:`.sandboxed`;
in a container image's root with ``agent.image``: :mod:`.image`) or ``kubernetes`` (a Job:
:mod:`.kubernetes`). A new runner is a file here with a class that has the
verbs of :class:`~.base.Runner` and a ``check(agent, environ)`` static method, and one line in
``RUNNERS``; any options it takes are fields of :class:`~lgt.trainer.rollout.agent.AgentSpec`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from lgt.trainer.rollout.agent import RUNNERS, AgentSpec
from lgt.trainer.rollout.runners.base import Runner


def runner_class(agent: AgentSpec) -> type:
    """The class of ``agent``'s runner, imported from its :data:`RUNNERS` entry."""
    module, _, name = RUNNERS[agent.runner].partition(":")
    found = getattr(importlib.import_module(module), name)
    return found if isinstance(found, type) else found(agent)


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
