"""Which groups run: launching them under admission control, collecting their rollouts, handing the
finished ones to the recipe in batches — and, on a resume, what the store and the cluster say was left.

A *group* is ``group_size`` rollouts of one task launched under one policy version (:class:`Group`).
The decisions are :mod:`lgt.trainer.run.admission`'s pure functions; this module does the launching and
the bookkeeping around them. A resumed run finds in the store (the named queries of
``sql/scheduler.sql``) where the group numbers go on (``next_group``) and the groups that finished
before the crash but were never trained (``recorded_groups``); with Kubernetes Jobs, the Jobs that
outlived the old trainer are adopted (``recorded_attempts`` says which attempts the store holds
already).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lgt.store.query import connect, named_queries
from lgt.trainer.run import admission
from lgt.trainer.run.progress import Progress

FAIL_FAST_GROUPS = 2  # groups that all failed, with no rollout ever ok, end the run


QUERIES = named_queries("lgt.trainer.run", "sql/scheduler.sql")


@dataclass
class Group:
    """``group_size`` rollouts of one task launched together; advantages are taken within it."""

    index: int
    task: dict[str, Any]
    version: int  # policy version when launched
    results: list[Any] = field(default_factory=list)
    pending: int = 0
    recovered_ok: int = 0  # rollouts that finished ok before a restart (their rows are in the store)

    @property
    def group_id(self) -> str:
        return f"g{self.index:06d}"

    def rollout_id(self, k: int) -> str:
        return f"{self.group_id}-{k}"

    @property
    def done(self) -> bool:
        return self.pending == 0


def next_group(store: Path) -> int:
    """The index of the first group not in the store."""
    con = connect(store)
    try:
        return int(con.execute(QUERIES["next_group"]).fetchone()[0])
    finally:
        con.close()


def finished_groups(store: Path, tasks: list[dict[str, Any]], group_size: int, trained: set[str]
                    ) -> list[Group]:
    """The groups whose ``group_size`` rollouts are all recorded, of a task in ``tasks``, not ``trained``."""
    con = connect(store)
    try:
        rows = con.execute(QUERIES["recorded_groups"]).fetchall()
    finally:
        con.close()
    by_id = {t["task_id"]: t for t in tasks}
    return [Group(index=int(gid[1:]), task=by_id[task_id], version=int(step or 0))
            for gid, task_id, n, step in rows
            if gid not in trained and n >= group_size and task_id in by_id]


def recorded_attempts(store: Path, group_ids: list[str]) -> dict[str, dict[int, str]]:
    """Per rollout of these groups: each recorded attempt's status."""
    con = connect(store)
    try:
        recorded: dict[str, dict[int, str]] = {}
        rows = con.execute(QUERIES["recorded_attempts"], {"groups": group_ids}).fetchall()
        for rid, attempt, status in rows:
            recorded.setdefault(rid, {})[attempt] = status
    finally:
        con.close()
    return recorded


def agent_broken(n_groups: int, results: list[Any]) -> str:
    """The sentence that ends a run whose agent has not once finished: its last attempt's error (the
    controller's, which names the last line the agent wrote to stderr)."""
    last = results[-1] if results else None
    said = "" if last is None else \
        f"; its last attempt: {last.error or f'status {last.status}'} ({last.stderr_path})"
    return f"the agent failed in every rollout of the first {n_groups} groups, so it does not run here{said}"


class GroupScheduler:
    """Groups of ``tasks`` launched on ``controller`` (a rollout controller: ``run``, ``aclose``, and for
    Jobs ``existing_jobs``) while ``limits`` allow; ``ready`` holds the finished ones not yet trained.

    ``progress``: the policy version new groups are launched at and how many updates this process made;
    ``retries``: the agent's (a Job's rollout whose last attempt was the last is not run again);
    ``rollouts_dir``: where the rollouts' logs are (named when a group fails whole); ``log``: a line for
    the person watching; ``record``: each rollout's result (rollouts.jsonl); ``refresh``: the status
    line, after each rollout; ``groups_left``: how many more groups the run will train (None: no
    step or sample limit), so that no group is launched it could not train."""

    def __init__(self, controller: Any, store: Path, tasks: list[dict[str, Any]], limits: admission.Limits,
                 *, seed: int, retries: int, progress: Progress, rollouts_dir: Path,
                 log: Callable[[str], None], record: Callable[[Any], None] = lambda res: None,
                 refresh: Callable[[], None] = lambda: None,
                 groups_left: Callable[[], int | None] = lambda: None) -> None:
        self.controller = controller
        self.store = store
        self.tasks = tasks
        self.limits = limits
        self.seed = seed
        self.retries = retries
        self.progress = progress
        self.rollouts_dir = rollouts_dir
        self.log = log
        self.record = record
        self.refresh = refresh
        self.groups_left = groups_left
        self.groups: dict[str, Group] = {}  # launched, not trained
        self.ready: list[Group] = []  # finished, not trained
        self.next_group = self.first_group_this_run = 0
        self.ok_rollouts = 0  # rollouts that ended ok in this process
        self.failed_groups = 0  # groups whose every rollout failed, in this process (never trained)
        self.failed_groups_reported = 0  # of them, counted in a step's metrics already
        self.fatal: str | None = None  # set when the run cannot go on
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------------------ resume
    def recover(self, *, resume: bool) -> None:
        """Group numbers go on after the store's; on a resume, groups whose rollouts all finished but
        that were not trained are trained now."""
        self.next_group = next_group(self.store)
        if not resume:
            return
        trained = self.progress.trained_groups
        for g in finished_groups(self.store, self.tasks, self.limits.group_size, trained):
            self.groups[g.group_id] = g
            self.ready.append(g)
        if self.ready:
            self.log(f"{len(self.ready)} finished group(s) from before the restart will be trained")

    def begin(self) -> None:
        """Training starts (or starts again) in this process: admission counts groups from here."""
        self.first_group_this_run = self.next_group

    async def adopt_jobs(self) -> None:
        """runner: kubernetes, on --resume: the groups whose Jobs outlived the old controller are
        finished — each rollout from the attempt its Job runs (adopted: waited for, or collected if it
        ended meanwhile, never made twice), or the next attempt, or not at all when it had ended. A group
        that :meth:`recover` found finished in the store while a newer attempt's Job still runs (a
        retry) is taken back and finished the same way, not trained without that attempt."""
        jobs = await self.controller.existing_jobs()
        by_group: dict[str, list[dict[str, str]]] = {}
        for j in jobs:
            if j.get("role", "agent") != "agent":
                continue  # an evaluator Job: its rollout's attempt is run (or adopted) again with it
            if j.get("group", "").startswith("g") and j["group"][1:].isdigit():
                by_group.setdefault(j["group"], []).append(j)
        if not by_group:
            return
        recorded = recorded_attempts(self.store, list(by_group))
        by_id = {t["task_id"]: t for t in self.tasks}
        adopted = 0
        for gid, group_jobs in sorted(by_group.items()):
            task = by_id.get(group_jobs[0].get("task", ""))
            recovered = self.groups.get(gid)
            if recovered is not None and recovered in self.ready and any(
                    int(j["attempt"]) > max(recorded.get(j.get("rollout", ""), {}), default=-1)
                    for j in group_jobs):  # recovery counted it finished, but a newer attempt's Job runs
                self.ready.remove(recovered)
                del self.groups[gid]
            if gid in self.progress.trained_groups or gid in self.groups or task is None:
                continue
            g = Group(index=int(gid[1:]), task=task, version=int(group_jobs[0].get("step") or 0))
            self.next_group = max(self.next_group, g.index + 1)
            todo = []
            for k in range(self.limits.group_size):
                rid = g.rollout_id(k)
                rec = recorded.get(rid, {})
                job_attempts = [int(j["attempt"]) for j in group_jobs if j.get("rollout") == rid]
                last = max(rec, default=-1)
                if job_attempts and max(job_attempts) > last:
                    todo.append((k, max(job_attempts)))  # its Job: adopted
                    adopted += 1
                elif rec and (rec[last] == "ok" or last >= self.retries):
                    g.recovered_ok += rec[last] == "ok"
                else:
                    todo.append((k, last + 1))
            self.groups[gid] = g
            g.pending = len(todo)
            if not todo:
                self.groups.pop(gid)
                if g.recovered_ok:
                    self.ready.append(g)
                continue
            for k, first in todo:
                self._spawn(self.one_rollout(g, k, first))
        self.log(f"resumed {len(by_group)} group(s) whose Jobs outlived the last run: "
                 f"{adopted} Job(s) adopted")

    # ------------------------------------------------------------------------------ launching
    @property
    def running(self) -> int:
        """Rollouts launched and not finished."""
        return sum(g.pending for g in self.groups.values())

    def unfinished_groups(self) -> int:
        return sum(1 for g in self.groups.values() if not g.done)

    def counts(self) -> tuple[int, int, int]:
        """Rollouts running, done and failed (the status line)."""
        return (self.running, getattr(self.controller, "done", 0), getattr(self.controller, "failed", 0))

    def launch(self) -> None:
        """Start groups while admission control allows (:func:`lgt.trainer.run.admission.may_launch`)."""
        while admission.may_launch(
                self.limits, running_rollouts=self.running,
                unfinished_groups=self.unfinished_groups(), ready_groups=len(self.ready),
                # a group whose every rollout failed is never trained: it leaves the staleness
                # window, or a burst of failures (an engine or proxy restart) would stop all launches
                launched_this_run=self.next_group - self.first_group_this_run - self.failed_groups,
                updates_this_run=self.progress.updates_this_run, groups_left=self.groups_left()):
            self.start_group()

    def start_group(self) -> None:
        task = self.tasks[admission.task_index(self.seed, len(self.tasks), self.next_group)]
        g = Group(index=self.next_group, task=task, version=self.progress.version,
                  pending=self.limits.group_size)
        self.next_group += 1
        self.groups[g.group_id] = g
        for k in range(self.limits.group_size):
            self._spawn(self.one_rollout(g, k))

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def one_rollout(self, g: Group, k: int, first_attempt: int = 0) -> None:
        try:
            res = await self.controller.run(g.task, g.rollout_id(k), g.group_id, g.version,
                                            first_attempt=first_attempt)
        except Exception as e:  # noqa: BLE001 - one rollout's crash must not end the run
            self.log(f"rollout {g.rollout_id(k)} could not run: {e}")
            res = None
        g.results.append(res)
        g.pending -= 1
        if res is not None:
            self.ok_rollouts += res.ok
            self.record(res)
        if g.done:
            if g.recovered_ok or any(r is not None and r.status == "ok" for r in g.results):
                self.ready.append(g)
            else:
                self.log(f"group {g.group_id}: every rollout failed; see {self.rollouts_dir}")
                self.groups.pop(g.group_id, None)
                self.failed_groups += 1
                if self.fatal is None and self.ok_rollouts == 0 and self.failed_groups >= FAIL_FAST_GROUPS:
                    self.fatal = agent_broken(self.failed_groups, [r for r in g.results if r is not None])
        self.refresh()
        self.wake()

    # ------------------------------------------------------------------------------ batches
    def batch_ready(self) -> bool:
        """Enough finished groups for a batch (sync: and no group of the step's batch still running)."""
        return len(self.ready) >= self.limits.batch_groups and \
            not (self.limits.mode == "sync" and self.unfinished_groups())

    async def wait(self, timeout: float = 1.0) -> None:
        """Until a rollout or an evaluation ends, or ``timeout`` seconds."""
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=timeout)

    def wake(self) -> None:
        self._wake.set()

    def take_batch(self) -> list[Group]:
        """The ``batch_groups`` oldest finished groups (:func:`~.admission.take_batch`)."""
        batch, self.ready = admission.take_batch(self.ready, self.limits.batch_groups)
        return batch

    def trained(self, batch: list[Group]) -> None:
        for g in batch:
            self.groups.pop(g.group_id, None)

    def failed_since_last(self) -> int:
        """Groups whose every rollout failed since the last call (a step's ``rollout/groups_failed``)."""
        n, self.failed_groups_reported = self.failed_groups - self.failed_groups_reported, self.failed_groups
        return n

    # ------------------------------------------------------------------------------ the end
    async def stop_rollouts(self) -> None:
        """Training is over: the unfinished rollouts are cancelled, and waited for."""
        running = list(self._tasks)
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    async def aclose(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        with contextlib.suppress(Exception):
            await self.controller.aclose()
