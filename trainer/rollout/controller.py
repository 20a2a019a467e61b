"""The rollout controller: run an unmodified agent program once per rollout, through lgt-proxy.

The controller schedules attempts; where one runs is its runner's business
(:mod:`lgt.trainer.rollout.runners`: a local process, a sandboxed one, a Kubernetes Job). Each attempt of
a rollout gets the environment described in :mod:`lgt.trainer.rollout.agent`, under identity
``<rollout_id>~<attempt>``; at most ``concurrency`` attempts (and evaluators) run at a time.

stdout and stderr go to ``<run_dir>/rollouts/<rollout_id>~<attempt>.out`` / ``.err``. Past
``timeout_s`` the attempt is killed: status ``timeout``. A non-zero exit is ``failed``. After a zero exit
the reward is taken from the first of:

1. the proxy's reward endpoint (the agent POSTed to ``$LGT_REWARD_URL``): the proxy's
   ``GET /rewards`` answers its latest whole-rollout reward for this attempt from memory;
2. the reward file;
3. the last line of stdout, when it is a number or ``{"reward": x}``;
4. the evaluator command, run as ``evaluator... TASK_JSON STDOUT_PATH`` with the task variables: its
   last stdout line.

``AgentSpec.reward_sources`` can leave some of these out. An attempt that exits 0 with no reward is
``failed`` (never trained as reward 0). Each attempt is recorded as a ``rollouts`` row and its
reward as a ``rewards`` row (unless it came from the proxy, which recorded it already): at once, or
with ``batch_records`` when the owner calls :meth:`RolloutController.flush_records` (one file per
table per batch — the training loop does so at each update). Failed and timed-out attempts are retried up to
``AgentSpec.retries`` times, each under its own identity, so the store keeps attempts apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import re
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lgt.proxy import auth
from lgt.store.files import write_atomic
from lgt.store.ingest import add_rows, attempt_reward_row, rollout_row
from lgt.store.schema import ROLLOUT_SPLITS
from lgt.store.writer import os_reason
from lgt.trainer.rollout.agent import (
    RESERVED_VARS,
    SOURCE_NAMES,
    AgentSpec,
    RolloutError,
    describe_exit,
    last_line,
    parse_reward,
    stderr_hint,
    task_env,
    task_id_of,
)
from lgt.trainer.rollout.runners import check_agent, make_runner
from lgt.trainer.rollout.runners.base import Attempt, Paths
from lgt.trainer.serving.proxy import ProxyClient

if TYPE_CHECKING:
    from lgt.trainer.rollout.resources import Resources


class StoreWriteError(RuntimeError):
    """The store cannot be written (a full or read-only disk); one sentence."""


@dataclass(frozen=True)
class RolloutResult:
    """One attempt's outcome (``run`` returns the last attempt). Times are UTC; ``seconds`` is the
    agent process's wall time; ``reward`` is set only when ``status == "ok"``."""

    rollout_id: str
    attempt: int
    task_id: str
    group_id: str | None
    step: int | None
    status: str
    exit_code: int | None
    reward: float | None
    reward_source: str | None
    started_at: dt.datetime
    ended_at: dt.datetime
    seconds: float
    stdout_path: Path
    stderr_path: Path
    error: str | None = None
    split: str = "train"  # eval: a held-out evaluation rollout (recorded, never trained)
    resource_version: str | None = None  # the resources it ran with (lgt.trainer.rollout.resources)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def identity(self) -> str:
        return auth.Identity(self.rollout_id, self.attempt).name


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# -- the controller ---------------------------------------------------------------------------------
class RolloutController:
    """Runs rollouts on the agent's runner, at most ``concurrency`` attempts at a time (and evaluators).

    Counters for a progress display: ``running`` (attempts in progress), ``done`` (rollouts finished,
    whatever their status), ``failed`` (finished rollouts whose last attempt is not ``ok``),
    ``retried`` (attempts that were retried).
    """

    def __init__(self, agent: AgentSpec, proxy: ProxyClient | Sequence[ProxyClient],
                 store: str | os.PathLike, run_dir: str | os.PathLike, concurrency: int = 4, *,
                 kill_grace_s: float = 5.0, batch_records: bool = False,
                 resources: Resources | None = None, hide: Sequence[str | os.PathLike] = ()) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise RolloutError(f"rollout concurrency must be a whole number ≥ 1, not {concurrency!r}")
        check_agent(agent)
        self.store = Path(store).resolve()
        self.run_dir = Path(run_dir).resolve()
        # what no sandboxed attempt may see, besides the store and the run directory
        hidden = [Path(p).resolve() for p in (*hide, self.store, self.run_dir)]
        self.runner = make_runner(agent, run_dir=self.run_dir, kill_grace_s=kill_grace_s, hidden=hidden)
        # batch_records: rows wait in memory for flush_records() (one file per table per batch,
        # instead of two files per attempt); a crash loses only unflushed rollouts' rows
        self.batch_records = batch_records
        self._rows: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
        self._rows_lock = threading.Lock()
        if not self.store.is_dir():
            raise RolloutError(f"the store directory {str(self.store)!r} does not exist")
        # several proxy replicas on one store: each rollout keeps to one (its calls, its reward)
        self.proxies = [proxy] if isinstance(proxy, ProxyClient) else list(proxy)
        if not self.proxies:
            raise RolloutError("the rollout controller needs at least one proxy")
        self.agent, self.proxy = agent, self.proxies[0]
        self.out_dir = self.run_dir / "rollouts"
        self.concurrency, self.kill_grace_s = concurrency, kill_grace_s
        self.running = self.done = self.failed = self.retried = 0
        self._slots = asyncio.Semaphore(concurrency)
        self._closed = False
        self.resources = resources  # prompts delivered to every rollout (lgt.trainer.rollout.resources)

    # -- public ---------------------------------------------------------------------------------------
    async def run(self, task: Mapping[str, Any], rollout_id: str, group_id: str | None = None,
                  step: int | None = None, *, task_id: str | None = None, split: str = "train",
                  greedy: bool = False, first_attempt: int = 0) -> RolloutResult:
        """Run attempt 0, then 1, 2, ... while they fail or time out, up to ``agent.retries`` extra;
        returns the last attempt's result. ``split="eval"`` records a held-out evaluation rollout
        (never trained); ``greedy`` has the proxy decode its calls greedily; ``first_attempt`` continues a
        rollout whose earlier attempts ran before a restart. RolloutError for a bad
        task or rollout id (nothing runs); ProxyControlError when the proxy's CA is not in the store
        yet; ControlError when the proxy does not answer a reward lookup (its rewards would be
        missed)."""
        if self._closed:
            raise RolloutError("the rollout controller is closed; make a new one to run more rollouts")
        if not isinstance(task, Mapping):
            raise RolloutError(f"a task must be a mapping of fields to values, not {type(task).__name__}")
        try:
            auth.check_rollout_id(rollout_id)
        except ValueError as e:
            raise RolloutError(str(e)) from None
        if split not in ROLLOUT_SPLITS:
            raise RolloutError(f"rollout split {split!r} is not one of {', '.join(ROLLOUT_SPLITS)}")
        task_id = task_id or task_id_of(task)
        try:
            task_json = json.dumps(dict(task), ensure_ascii=False).encode()
        except (TypeError, ValueError) as e:
            raise RolloutError(f"task {task_id!r} cannot be written as JSON ({e})") from None
        fields = task_env(task, self.agent.task_env_prefix)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        result = None
        for attempt in range(first_attempt, max(first_attempt, self.agent.retries) + 1):
            result = await self._attempt(task_json, fields, rollout_id, attempt, task_id, group_id, step,
                                         split=split, greedy=greedy, task=dict(task))
            if result.ok or self._closed:
                break
            if attempt < self.agent.retries:
                self.retried += 1
        assert result is not None
        self.done += 1
        self.failed += not result.ok
        return result

    async def existing_jobs(self) -> list[dict[str, str]]:
        """runner: kubernetes — the run's Jobs that exist in the cluster now (labels ``rollout``,
        ``attempt``, ``group``, ``task``, ``step``), e.g. after a restart; ``[]`` for local processes."""
        return await self.runner.existing()

    async def aclose(self) -> None:
        """Stop everything still running (SIGTERM to each process group, SIGKILL after the grace
        period; Jobs deleted); later ``run`` calls are refused. Safe to call twice."""
        self._closed = True
        await self.runner.aclose()
        if self._rows[0] or self._rows[1]:
            await asyncio.to_thread(self.flush_records)

    async def __aenter__(self) -> RolloutController:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- one attempt ----------------------------------------------------------------------------------
    def proxy_for(self, rollout_id: str) -> ProxyClient:
        """The replica a rollout's attempts go through (the same one for all of them)."""
        if len(self.proxies) == 1:
            return self.proxies[0]
        return self.proxies[zlib.crc32(rollout_id.encode()) % len(self.proxies)]

    def paths(self, rollout_id: str, attempt: int) -> Paths:
        """The attempt's files: ``<run_dir>/rollouts/<rollout_id>~<attempt>.out`` (``.err``,
        ``.task.json``, ``.reward``, ``.eval.out``, ``.eval.err``)."""
        return Paths.of(self.out_dir, rollout_id, attempt)

    async def _attempt(self, task_json: bytes, fields: Mapping[str, str], rollout_id: str, attempt: int,
                       task_id: str, group_id: str | None, step: int | None, *, split: str = "train",
                       greedy: bool = False, task: Mapping[str, Any] | None = None) -> RolloutResult:
        paths = self.paths(rollout_id, attempt)
        res = self.resources  # this attempt's version, whatever a prompt optimiser sets meanwhile
        filled = res.for_task(task or {}) if res is not None else {}
        # what the agent sees of its task: all but the private fields (the evaluator gets them all)
        view = {k: v for k, v in (task or {}).items() if k not in self.agent.private}
        agent_fields = {k: v for k, v in fields.items()
                        if k in task_env(view, self.agent.task_env_prefix)} if self.agent.private else fields
        agent_json = json.dumps(view, ensure_ascii=False).encode() if self.agent.private else task_json
        a = Attempt(rollout_id=rollout_id, attempt=attempt, task_id=task_id, group_id=group_id, step=step,
                    greedy=greedy, proxy=self.proxy_for(rollout_id), paths=paths, fields=agent_fields,
                    agent_json=agent_json)
        self._place_resources(a, res, filled)
        write_atomic(paths.task_json, task_json)
        for stale in (paths.reward_file, paths.eval_out, paths.eval_err):
            stale.unlink(missing_ok=True)
        self.runner.prepare(a)
        async with self._slots:
            started, t0 = _now(), time.monotonic()
            if self._closed:
                await self.runner.release(a)
                return self._result(rollout_id, attempt, task_id, group_id, step, "failed", None, None, None,
                                    started, 0.0, paths, "the controller was closed before it started")
            self.running += 1
            try:
                error = await self._deliver(res, filled, rollout_id, attempt)
                if error is not None:
                    code, timed_out = None, False
                else:
                    code, timed_out, error = await self.runner.run(a)
                seconds = time.monotonic() - t0
                ended = _now()
                reward = source = None
                if error is not None or code is None:
                    status = "failed"
                elif timed_out:
                    status, error = "timeout", (f"the agent ran past its {self.agent.timeout_s:g} s timeout "
                                                "and was killed")
                elif self._closed:
                    status, error = "failed", f"the agent {describe_exit(code)} when the controller closed"
                elif code != 0:
                    status, error = "failed", f"the agent {describe_exit(code)}" + stderr_hint(paths.stderr)
                else:
                    self.runner.collect(a)
                    eval_env = self._evaluator_env(fields, rollout_id, attempt, task_id, paths, a.work)
                    reward, source, error = await self._reward(a, eval_env)
                    status = "ok" if reward is not None else "failed"
            finally:
                self.running -= 1
                await self.runner.release(a)
        result = self._result(rollout_id, attempt, task_id, group_id, step, status, code, reward, source,
                              started, seconds, paths, error, ended, split)
        if res is not None:
            result = dataclasses.replace(result, resource_version=res.version)
        await asyncio.to_thread(self._record, result)
        return result

    def _place_resources(self, a: Attempt, res: Resources | None, filled: Mapping[str, str]) -> None:
        """The attempt's resource variables (``deliver: env``, and the paths of ``deliver: file``, whose
        files its runner places)."""
        if res is None:
            return
        from lgt.trainer.rollout.resources import env_name

        for name, spec in res.specs.items():
            if spec.deliver == "env":
                a.extra_env[env_name(name)] = filled[name]
            elif spec.deliver == "file":
                fname = f"resource-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.txt"
                a.extra_env[env_name(name) + "_FILE"] = self.runner.place(a, fname, filled[name].encode())

    async def _deliver(self, res: Resources | None, filled: Mapping[str, str], rollout_id: str,
                       attempt: int) -> str | None:
        """``deliver: proxy``: register the attempt's prompt with its proxy before it starts; the reason
        when that fails (the attempt fails: it would run on the agent's own prompt)."""
        subs = res.substitutions(filled) if res is not None else []
        if not subs:
            return None
        from lgt.proxy.client import ControlError

        try:
            await asyncio.to_thread(self.proxy_for(rollout_id).api.deliver, rollout_id, attempt, subs)
        except (ControlError, OSError) as e:
            return f"could not deliver the resources to the proxy: {e}"
        return None

    def _result(self, rollout_id: str, attempt: int, task_id: str, group_id: str | None, step: int | None,
                status: str, code: int | None, reward: float | None, source: str | None,
                started: dt.datetime, seconds: float, paths: Paths, error: str | None,
                ended: dt.datetime | None = None, split: str = "train") -> RolloutResult:
        return RolloutResult(rollout_id=rollout_id, attempt=attempt, task_id=task_id, group_id=group_id,
                             step=step, status=status, exit_code=code, reward=reward, reward_source=source,
                             started_at=started, ended_at=ended or started, seconds=seconds,
                             stdout_path=paths.stdout, stderr_path=paths.stderr, error=error, split=split)

    def _evaluator_env(self, fields: Mapping[str, str], rollout_id: str, attempt: int, task_id: str,
                       paths: Paths, work: Path | None) -> dict[str, str]:
        """What the evaluator is given: every task field (the private ones too), the whole task's file,
        the attempt's identity and, sandboxed, ``LGT_WORK_DIR``: the agent's work folder, as it left it
        (the agent wrote it: read it as untrusted input)."""
        env = dict(fields)
        env.update(TASK_JSON=str(paths.task_json), TASK_ID=task_id, REWARD_FILE=str(paths.reward_file),
                   LGT_ROLLOUT_ID=rollout_id, LGT_ATTEMPT=str(attempt))
        if work is not None:
            env["LGT_WORK_DIR"] = str(work)
        return env

    # -- rewards and records --------------------------------------------------------------------------
    async def _reward(self, a: Attempt,
                      env: Mapping[str, str]) -> tuple[float | None, str | None, str | None]:
        """(reward, source, error) from the first of ``agent.reward_sources`` that has one."""
        sources, paths = self.agent.reward_sources, a.paths
        if "proxy" in sources:
            # the latest whole-rollout reward the agent reported through the proxy (GET /rewards:
            # answered from the proxy's memory, no flush and no store query per rollout)
            value = await asyncio.to_thread(a.proxy.api.reward, a.rollout_id, a.attempt)
            if value is not None:
                return value, "proxy", None
        if "file" in sources and paths.reward_file.exists():
            text = paths.reward_file.read_text(errors="replace")
            try:
                return parse_reward(text), "file", None
            except ValueError as e:
                return None, None, f"the reward file {paths.reward_file} is unusable: {e}"
        line = last_line(paths.stdout) if "stdout" in sources else None
        if line is not None:
            with contextlib.suppress(ValueError):
                return parse_reward(line), "stdout", None
        if "evaluator" in sources and self.agent.evaluator is not None:
            return await self._evaluate(a, env)
        looked = ", ".join(SOURCE_NAMES[s] for s in sources
                           if s != "evaluator" or self.agent.evaluator is not None)
        return None, None, f"the agent exited 0 but reported no reward (looked at: {looked or 'nothing'})"

    async def _evaluate(self, a: Attempt, env: Mapping[str, str]) -> tuple[float | None, str | None,
                                                                            str | None]:
        assert self.agent.evaluator is not None
        paths = a.paths
        eval_env = {k: v for k, v in os.environ.items() if k not in (auth.SECRET_ENV, auth.CONTROL_TOKEN_ENV)}
        eval_env.update({k: v for k, v in env.items()
                         if k.startswith(self.agent.task_env_prefix) or k in RESERVED_VARS
                         or k in ("LGT_ROLLOUT_ID", "LGT_ATTEMPT", "LGT_WORK_DIR")})
        code, timed_out, error = await self.runner.evaluate(a, eval_env)
        if error is not None:
            return None, None, f"the evaluator {error.removeprefix('could not start ')}"
        if timed_out:
            return None, None, f"the evaluator ran past its {self.agent.timeout_s:g} s timeout and was killed"
        if code != 0:
            return None, None, f"the evaluator {describe_exit(code)}" + stderr_hint(paths.eval_err)
        line = last_line(paths.eval_out)
        if line is None:
            return None, None, "the evaluator printed nothing (its last stdout line should be the reward)"
        try:
            return parse_reward(line), "evaluator", None
        except ValueError as e:
            return None, None, f"the evaluator's last stdout line is unusable: {e}"

    def _record(self, r: RolloutResult) -> None:
        """The attempt's rollouts row, then its reward row unless the proxy recorded it already."""
        metadata: dict[str, Any] = {"reward_source": r.reward_source, "seconds": round(r.seconds, 6)}
        if r.error:
            metadata["error"] = r.error
        row = rollout_row(r.rollout_id, attempt=r.attempt, task_id=r.task_id, group_id=r.group_id,
                          step=r.step, status=r.status, exit_code=r.exit_code, started_at=r.started_at,
                          ended_at=r.ended_at, split=r.split, metadata=metadata,
                          resource_version=r.resource_version)
        reward = None
        if r.reward is not None and r.reward_source != "proxy":
            reward = attempt_reward_row(r.rollout_id, r.reward, attempt=r.attempt, source=r.reward_source)
        with self._rows_lock:  # _record and flush_records run in worker threads
            self._rows[0].append(row)
            if reward is not None:
                self._rows[1].append(reward)
        if not self.batch_records:
            self.flush_records()

    def flush_records(self) -> int:
        """Write the rows of attempts finished since the last call (one file per table); their count.
        A store that cannot be written (a full disk) keeps the rows for the next call and raises
        :class:`StoreWriteError`, one sentence."""
        with self._rows_lock:
            rollouts, rewards = self._rows
            self._rows = ([], [])
        try:
            add_rows(self.store, rollouts, rewards)
        except OSError as e:
            with self._rows_lock:  # nothing lost: the next flush writes them
                self._rows = (rollouts + self._rows[0], rewards + self._rows[1])
            raise StoreWriteError(f"the store {self.store} cannot be written ({os_reason(e)}): free space "
                                  "there, then continue the run with lgt-train run --resume") from None
        return len(rollouts)

