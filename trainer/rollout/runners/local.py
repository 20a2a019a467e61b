"""The local runner: each attempt a process of this machine, in its own process group.

With ``agent.python_preload`` (a Python agent: ``python agent.py ...``) each attempt is forked from a warm
interpreter that imported those modules once (:mod:`lgt.trainer.rollout.forkserver`); it is still its own
process group with the same environment, files, timeout and exit status. Past ``timeout_s`` the whole
group gets SIGTERM, then SIGKILL after ``kill_grace_s``; whatever the group still holds when the agent
exits is killed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

from lgt.store.files import write_atomic
from lgt.trainer.rollout import sandbox as sandboxing
from lgt.trainer.rollout.agent import (
    STRIPPED_VARS,
    AgentSpec,
    RolloutError,
    check_env_refs,
    expand,
    real_python,
    resolve_executable,
)
from lgt.trainer.rollout.forkserver import ForkedProcess, ForkServer, ForkServerError, python_script_command
from lgt.trainer.rollout.runners.base import Attempt, Outcome
from lgt.trainer.serving.children import signal_group


class LocalRunner:
    """Attempts as processes of this machine (``agent.runner: local`` with ``agent.sandbox: none``)."""

    def __init__(self, agent: AgentSpec, *, run_dir: Path, kill_grace_s: float = 5.0,
                 hidden: Sequence[Path] = ()) -> None:
        self.agent, self.kill_grace_s = agent, kill_grace_s
        self.out_dir = run_dir / "rollouts"
        self.work_root = self.out_dir / "work"
        self._preload: tuple[str, tuple[str, ...]] | None = None
        if agent.python_preload is not None:
            # the agent's interpreter as the agent would run it: a relative path (an agent's own
            # environment, e.g. .venv/bin/python) is relative to the agent's working directory
            python = resolve_executable(python_script_command(agent.command)[0], agent.cwd,
                                        os.environ.get("PATH"), "agent command")
            self._preload = (real_python(python, agent.cwd), agent.python_preload)
        self._procs: set[asyncio.subprocess.Process | ForkedProcess] = set()
        self._closed = False
        self._forkserver: ForkServer | None = None
        self._forkserver_lock = asyncio.Lock()
        self._layout_keep: list[str] = []  # sandboxed: the zygote's own folders, which stay

    @classmethod
    def check(cls, agent: AgentSpec, environ: Mapping[str, str]) -> None:
        """RolloutError (one sentence) when the agent cannot start here: a missing working directory,
        command or evaluator not found or not executable, an ``env`` value naming an unset variable."""
        if agent.cwd is not None and not agent.cwd.is_dir():
            raise RolloutError(f"the agent's working directory {str(agent.cwd)!r} does not exist")
        cls._check_sandbox(agent)
        resolve_executable(agent.command[0], agent.cwd, environ.get("PATH"), "agent command")
        if agent.evaluator is not None:
            resolve_executable(agent.evaluator[0], agent.cwd, environ.get("PATH"), "evaluator command")
        check_env_refs(agent, environ)

    @staticmethod
    def _check_sandbox(agent: AgentSpec) -> None:
        """The sandboxed runner's own checks (none here)."""

    # -- an attempt --------------------------------------------------------------------------------
    def place(self, a: Attempt, filename: str, data: bytes) -> str:
        path = self.out_dir / f"{a.name}.{filename}"
        write_atomic(path, data)
        return str(path)

    def prepare(self, a: Attempt) -> None:
        """The machine's environment minus :data:`STRIPPED_VARS`, the proxy's, the task's and the agent's
        variables; the agent's own view of its task when fields are private; its own empty work folder."""
        env = {k: v for k, v in os.environ.items() if k not in STRIPPED_VARS}
        env.update(a.proxy.rollout_env(a.rollout_id, a.attempt, self.agent.proxy_mode, greedy=a.greedy))
        env.update(a.fields)
        task_json = a.paths.task_json.with_suffix(".agent.json") if self.agent.private else a.paths.task_json
        env.update(TASK_JSON=str(task_json), TASK_ID=a.task_id, REWARD_FILE=str(a.paths.reward_file))
        env.update({k: expand(v, env, k) for k, v in self.agent.env.items()})
        env.update(a.extra_env)
        if self.agent.private:
            write_atomic(task_json, a.agent_json)
        a.work = self.work_root / a.name
        shutil.rmtree(a.work, ignore_errors=True)
        a.work.mkdir(parents=True)
        env["LGT_WORK_DIR"] = str(a.work)
        a.env = env

    async def run(self, a: Attempt) -> Outcome:
        return await self._execute(self.agent.command, a.env, a.paths.stdout, a.paths.stderr,
                                   forked=self._preload is not None)

    def collect(self, a: Attempt) -> None:
        """The reward file is where the agent wrote it."""

    async def evaluate(self, a: Attempt, env: Mapping[str, str]) -> Outcome:
        assert self.agent.evaluator is not None
        argv = (*self.agent.evaluator, str(a.paths.task_json), str(a.paths.stdout))
        return await self._execute(argv, env, a.paths.eval_out, a.paths.eval_err)

    async def release(self, a: Attempt) -> None:
        if a.work is not None:
            await asyncio.to_thread(shutil.rmtree, a.work, True)

    async def existing(self) -> list[dict[str, str]]:
        return []

    async def aclose(self) -> None:
        """SIGTERM to each process group still running, SIGKILL after the grace period; the fork server
        stopped."""
        self._closed = True
        procs = list(self._procs)
        for proc in procs:
            signal_group(proc.pid, signal.SIGTERM)
        await asyncio.gather(*(self._reap(proc) for proc in procs))
        if self._forkserver is not None:
            await self._forkserver.aclose()

    # -- processes ---------------------------------------------------------------------------------
    async def _execute(self, argv: tuple[str, ...], env: Mapping[str, str], stdout: Path,
                       stderr: Path, *, forked: bool = False) -> Outcome:
        """Run ``argv`` in its own process group until it exits or ``timeout_s`` passes (``forked``:
        forked from the warm fork server instead of started fresh)."""
        proc: asyncio.subprocess.Process | ForkedProcess
        if forked:
            try:
                server = await self._fork_server()
                proc = await server.spawn(argv[1:], env, self.agent.cwd, stdout, stderr)
            except ForkServerError as e:
                return Outcome(None, False, f"could not start {argv[1]!r} in the fork server: {e}")
        else:
            with open(stdout, "wb") as out, open(stderr, "wb") as err:
                try:
                    proc = await asyncio.create_subprocess_exec(
                        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err, env=dict(env),
                        cwd=self.agent.cwd, start_new_session=True)
                except OSError as e:
                    return Outcome(None, False, f"could not start {argv[0]!r}: {e.strerror or e}")
        return await self._wait(proc)

    async def _wait(self, proc: asyncio.subprocess.Process | ForkedProcess) -> Outcome:
        """Until ``proc`` exits or ``timeout_s`` passes (then SIGTERM, SIGKILL after the grace period);
        whatever its group still holds is killed."""
        self._procs.add(proc)
        if self._closed:  # aclose() ran while this one was starting
            signal_group(proc.pid, signal.SIGTERM)
        try:
            try:
                code = await asyncio.wait_for(proc.wait(), self.agent.timeout_s)
                timed_out = False
            except TimeoutError:
                signal_group(proc.pid, signal.SIGTERM)
                code = await self._reap(proc)
                timed_out = True
            signal_group(proc.pid, signal.SIGKILL)  # children left behind by the agent
        except asyncio.CancelledError:
            signal_group(proc.pid, signal.SIGKILL)
            raise
        finally:
            self._procs.discard(proc)
        return Outcome(code, timed_out, None)

    async def _reap(self, proc: asyncio.subprocess.Process | ForkedProcess) -> int:
        """Wait ``kill_grace_s`` for a signalled group's leader, then SIGKILL the group; exit code."""
        try:
            await asyncio.wait_for(proc.wait(), self.kill_grace_s)
        except TimeoutError:
            pass
        signal_group(proc.pid, signal.SIGKILL)
        return await proc.wait()

    async def _fork_server(self) -> ForkServer:
        """The warm interpreter (started on first use, and again if it died); sandboxed, in its sandbox
        (with no modules to preload: any Python, only to fork and exec each attempt)."""
        if self._forkserver is not None and self._forkserver.loop is not asyncio.get_running_loop():
            self._forkserver.abandon()  # started under an event loop that has ended
            self._forkserver = None
            self._forkserver_lock = asyncio.Lock()
        async with self._forkserver_lock:
            if self._forkserver is None or self._forkserver.proc.returncode is not None:
                python, modules = self._preload or (sandboxing.plain_python(), ())
                env = {k: v for k, v in os.environ.items() if k not in STRIPPED_VARS}
                layout = self._layout(python)
                self._forkserver = await ForkServer.start(python, modules, env=env, sandbox=layout)
                if layout is not None:  # with the zygote's own folders (its learning one), which stay
                    self._layout_keep = layout.keep()
            return self._forkserver

    def _layout(self, python: str) -> sandboxing.Layout | None:
        """What the fork server's sandbox shows (none: it runs unsandboxed)."""
        return None
