"""What a runner is: where one attempt of a rollout runs (a local process, a sandbox, a Kubernetes Job).

The controller (:mod:`lgt.trainer.rollout.controller`) schedules attempts — slots, retries, rewards,
records — and asks its runner, for each attempt, in this order:

1. ``place`` each resource file the attempt gets (where the agent finds it), then ``prepare`` its files
   and its environment (``Attempt.env``), before it waits for a slot;
2. ``run``: start it and wait until it exits or ``timeout_s`` passes (then it is killed): an
   :class:`Outcome`;
3. after a zero exit, ``collect`` what it left for the controller (its reward file), and ``evaluate``
   when the reward is the evaluator's;
4. ``release`` what it held (its work folder), whatever happened.

``existing`` lists the attempts still running from an earlier controller of the run (Kubernetes Jobs);
``aclose`` stops everything still running.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from lgt.trainer.serving.proxy import ProxyClient


@dataclass(frozen=True)
class Paths:
    """An attempt's files: ``<run_dir>/rollouts/<rollout_id>~<attempt>.out`` (``.err``, ``.task.json``,
    ``.reward``, ``.eval.out``, ``.eval.err``)."""

    stdout: Path
    stderr: Path
    task_json: Path
    reward_file: Path
    eval_out: Path
    eval_err: Path

    @classmethod
    def of(cls, out_dir: Path, rollout_id: str, attempt: int) -> Paths:
        stem = f"{rollout_id}~{attempt}"
        return cls(*(out_dir / f"{stem}.{ext}" for ext in ("out", "err", "task.json", "reward", "eval.out",
                                                           "eval.err")))


class Outcome(NamedTuple):
    """How an attempt (or its evaluator) ended: its exit code (None when it could not start), whether it
    ran past its timeout, and why it could not start."""

    code: int | None
    timed_out: bool = False
    error: str | None = None


@dataclass
class Attempt:
    """One attempt of a rollout, as the controller hands it to its runner."""

    rollout_id: str
    attempt: int
    task_id: str
    group_id: str | None
    step: int | None
    greedy: bool
    proxy: ProxyClient  # the proxy replica its calls go through
    paths: Paths
    fields: Mapping[str, str]  # the task's variables the agent sees (the private fields left out)
    agent_json: bytes  # what the agent sees of its task (the whole task is in paths.task_json)
    extra_env: dict[str, str] = field(default_factory=dict)  # its resources' variables
    files: dict[str, bytes] = field(default_factory=dict)  # files it gets beside its task (resources)
    env: dict[str, str] = field(default_factory=dict)  # its whole environment (``prepare``)
    work: Path | None = None  # its own folder ($LGT_WORK_DIR), when the runner gives it one

    @property
    def name(self) -> str:
        return f"{self.rollout_id}~{self.attempt}"


class Runner(Protocol):
    """Where attempts run; one per controller, named in :data:`lgt.trainer.rollout.agent.RUNNERS`."""

    def place(self, a: Attempt, filename: str, data: bytes) -> str:
        """Give the attempt a file; the path the agent reads it at."""
        ...

    def prepare(self, a: Attempt) -> None:
        """The attempt's files and its environment (``a.env``), before it waits for a slot."""
        ...

    async def run(self, a: Attempt) -> Outcome:
        """Start the agent and wait until it exits or ``timeout_s`` passes (then it is killed)."""
        ...

    def collect(self, a: Attempt) -> None:
        """After a zero exit: what the agent left for the controller, in ``a.paths``."""
        ...

    async def evaluate(self, a: Attempt, env: Mapping[str, str]) -> Outcome:
        """The evaluator, given ``TASK_JSON STDOUT_PATH`` and ``env``; its stdout in ``a.paths.eval_out``."""
        ...

    async def release(self, a: Attempt) -> None:
        """Whatever happened: what the attempt held (its work folder) is removed."""
        ...

    async def existing(self) -> list[dict[str, str]]:
        """The run's attempts that outlived an earlier controller (labels ``rollout``, ``attempt``,
        ``group``, ``task``, ``step``)."""
        ...

    async def aclose(self) -> None:
        """Stop everything still running; safe to call twice."""
        ...
