"""Held-out evaluation: the current policy on tasks it never trains on, through the same agent, proxy
and engine as training.

The held-out tasks are a file of their own (``eval.tasks``) or a share of the run's tasks split off by a
hash of each ``task_id`` (``eval.split``): the same tasks whatever the seed, the step or the machine,
and never launched for training. One evaluation runs, for each held-out task, one greedy rollout (the
proxy decodes its calls at temperature 0, whatever the agent asks: the identity it signs says so) and
``samples`` rollouts at the agent's own sampling; their rewards give ``eval/reward_greedy`` and
``eval/reward_sampled``. Eval rollouts are recorded in the store with ``split = 'eval'`` and a group of
their own (``e<step>-…``): inspectable with SQL, never turned into training samples.

The recipe evaluates before the first update, every ``every`` steps and once more when training ends;
no update happens while an evaluation runs, so all its calls are at one policy version (training
rollouts keep running beside it): :class:`Evaluator`. ``lgt-train eval`` evaluates a checkpoint or the
base model alone (:meth:`Evaluator.once`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EVAL_FILE = "eval.jsonl"
SPLIT_SALT = b"lgt-eval-split:"  # changes which tasks are held out only if changed here


@dataclass(frozen=True)
class EvalConfig:
    """The ``eval`` section of a run config."""

    tasks: Path | None = None  # a held-out tasks file (same format as the run's tasks)
    split: float | None = None  # or: this share of the run's tasks held out, by a hash of task_id
    every: int = 10  # steps between evaluations; 0: before the first update and at the end only
    greedy: bool = True  # one greedy rollout per task (eval/reward_greedy)
    samples: int = 2  # rollouts per task at the agent's own sampling (eval/reward_sampled)
    max_tasks: int | None = None  # evaluate at most this many held-out tasks (the first, in file order)

    def __post_init__(self) -> None:
        if (self.tasks is None) == (self.split is None):
            raise ValueError("eval needs exactly one of tasks (a held-out tasks file) or split (the share "
                             "of the run's tasks to hold out, e.g. 0.2)")
        if self.split is not None and not 0 < self.split < 1:
            raise ValueError(f"eval.split must be between 0 and 1 (the share held out), not {self.split}")
        if self.every < 0:
            raise ValueError(f"eval.every must be 0 or more steps, not {self.every}")
        if self.samples < 0:
            raise ValueError(f"eval.samples must be 0 or more, not {self.samples}")
        if not self.greedy and self.samples == 0:
            raise ValueError("eval runs nothing with greedy: false and samples: 0; set one of them")
        if self.max_tasks is not None and self.max_tasks < 1:
            raise ValueError(f"eval.max_tasks must be at least 1, not {self.max_tasks}")

    def due(self, step: int) -> bool:
        """Whether to evaluate after training step ``step`` (0: before the first update)."""
        return step == 0 or (self.every > 0 and step % self.every == 0)


def held_out(task_id: str, share: float) -> bool:
    """Whether ``task_id`` falls in the held-out ``share`` (a fixed hash: the same on every machine)."""
    digest = hashlib.sha256(SPLIT_SALT + task_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < share


def split_tasks(tasks: Sequence[dict[str, Any]], cfg: EvalConfig | None,
                eval_tasks: Sequence[dict[str, Any]] | None = None
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training tasks, held-out tasks). With a held-out file (``eval_tasks``), a training task that
    shares a task_id with it is refused: it would be trained on. ValueError names what is wrong."""
    if cfg is None:
        return list(tasks), []
    if cfg.split is not None:
        train = [t for t in tasks if not held_out(str(t["task_id"]), cfg.split)]
        held = [t for t in tasks if held_out(str(t["task_id"]), cfg.split)]
    else:
        held = list(eval_tasks or [])
        ids = {str(t["task_id"]) for t in held}
        both = [str(t["task_id"]) for t in tasks if str(t["task_id"]) in ids]
        if both:
            raise ValueError(f"task {both[0]!r} is in both the tasks file and eval.tasks ({len(both)} "
                             "shared): held-out tasks must never be trained on")
        train = list(tasks)
    if cfg.max_tasks is not None:
        held = held[:cfg.max_tasks]
    if not held:
        raise ValueError("eval holds out no task: raise eval.split or give eval.tasks")
    if not train:
        raise ValueError("eval.split holds out every task: nothing is left to train on")
    return train, held


def eval_group_id(step: int, index: int) -> str:
    return f"e{step:06d}-{index:05d}"


@dataclass
class EvalResult:
    step: int
    version: int
    greedy: list[float]  # one reward per greedy rollout that finished ok
    sampled: list[float]
    rollouts: int
    failed: int
    seconds: float

    def row(self, time_s: float) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "time_s": round(time_s, 3),
                "eval/reward_greedy": _mean(self.greedy), "eval/reward_sampled": _mean(self.sampled),
                "eval/tasks_greedy": len(self.greedy), "eval/rollouts": self.rollouts,
                "eval/failed": self.failed, "eval/seconds": round(self.seconds, 3)}

    def line(self) -> str:
        parts = [f"eval at step {self.step} (policy v{self.version}):"]
        if self.greedy or self.sampled:
            if self.greedy:
                parts.append(f"greedy {_mean(self.greedy):.3f}")
            if self.sampled:
                parts.append(f"sampled {_mean(self.sampled):.3f}")
        parts.append(f"({self.rollouts} rollouts, {self.failed} failed, {self.seconds:.1f} s)")
        return "  ".join(parts)


async def evaluate(cfg: EvalConfig, tasks: Sequence[dict[str, Any]], run_rollout: Callable[..., Any],
                   *, step: int, version: int) -> EvalResult:
    """Run one evaluation: ``run_rollout(task, rollout_id, group_id, step, split=, greedy=)`` is the
    rollout controller's ``run``. A rollout that failed (after its retries) counts in ``failed``, not as
    reward 0."""
    t0 = time.monotonic()
    jobs = []
    for i, task in enumerate(tasks):
        group = eval_group_id(step, i)
        if cfg.greedy:
            jobs.append((True, run_rollout(task, f"{group}-g", group, step, split="eval", greedy=True)))
        for k in range(cfg.samples):
            jobs.append((False, run_rollout(task, f"{group}-s{k}", group, step, split="eval")))
    results = await asyncio.gather(*(job for _, job in jobs), return_exceptions=True)
    greedy: list[float] = []
    sampled: list[float] = []
    failed = 0
    for (is_greedy, _), res in zip(jobs, results):
        if isinstance(res, BaseException) or not res.ok or res.reward is None:
            failed += 1
            continue
        (greedy if is_greedy else sampled).append(float(res.reward))
    return EvalResult(step, version, greedy, sampled, len(jobs), failed, time.monotonic() - t0)


class Evaluator:
    """The run's evaluations of ``tasks`` (the held-out ones): one at a time, beside the training
    rollouts; ``eval.jsonl`` in ``run_dir`` gets a row each. Without an eval section (``cfg`` None)
    it does nothing. ``run_rollout``: the rollout controller's ``run``; ``elapsed``: the run's clock
    (``time_s``); ``on_done``: called when an evaluation ends (the recipe's wait for a batch wakes);
    ``record``: each eval.jsonl row once written (the run's trackers)."""

    def __init__(self, cfg: EvalConfig | None, tasks: Sequence[dict[str, Any]],
                 run_rollout: Callable[..., Any], run_dir: Path, *, log: Callable[[str], None],
                 elapsed: Callable[[], float], on_done: Callable[[], None] = lambda: None,
                 record: Callable[[dict[str, Any]], None] = lambda row: None) -> None:
        self.cfg = cfg
        self.tasks = list(tasks)
        self.run_rollout = run_rollout
        self.run_dir = Path(run_dir)
        self.log = log
        self.elapsed = elapsed
        self.on_done = on_done
        self.record = record
        self.task: asyncio.Task | None = None  # the evaluation running now
        self.last_step: int | None = None  # the step last evaluated (at most one evaluation per step)

    @property
    def enabled(self) -> bool:
        return self.cfg is not None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def resume(self, step: int) -> None:
        """A resumed run at ``step``: evaluated already when eval.jsonl has that step."""
        done = {r.get("step") for r in _read_jsonl(self.run_dir / EVAL_FILE)}
        self.last_step = step if step in done else None

    def due(self, step: int) -> bool:
        return self.cfg is not None and self.cfg.due(step)

    def start(self, step: int, version: int) -> None:
        """Evaluate policy ``version`` (trained ``step`` steps) in the background, unless it was."""
        if self.cfg is None or self.running or self.last_step == step:
            return
        self.last_step = step
        self.task = asyncio.get_running_loop().create_task(self._run(step, version))

    async def wait(self) -> None:
        """Until the evaluation running now (if one is) has ended."""
        if self.task is not None:
            await self.task

    async def final(self, step: int, version: int) -> None:
        """Training is over: the final policy evaluated (unless it just was)."""
        await self.wait()
        self.start(step, version)
        await self.wait()

    async def once(self, step: int, version: int) -> EvalResult:
        """One evaluation, waited for; errors raised (``lgt-train eval``)."""
        assert self.cfg is not None
        res = await evaluate(self.cfg, self.tasks, self.run_rollout, step=step, version=version)
        row = res.row(max(0.0, self.elapsed()))
        append_row(self.run_dir, row)
        self.record(row)
        return res

    async def _run(self, step: int, version: int) -> None:
        try:
            res = await self.once(step, version)
            self.log(res.line())
        except Exception as e:  # noqa: BLE001 - an evaluation that cannot run must not end training
            self.log(f"the evaluation at step {step} could not run: {e}")
        finally:
            self.on_done()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    from lgt.trainer.report.summary import read_jsonl

    return read_jsonl(path)


def append_row(run_dir: Path, row: dict[str, Any]) -> None:
    with open(Path(run_dir) / EVAL_FILE, "a") as f:
        f.write(json.dumps(row) + "\n")


def _mean(xs: Sequence[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None

