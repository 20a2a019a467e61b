"""The sandboxed runner (``agent.runner: local``, ``agent.sandbox: bwrap``, the default): each attempt forked
into namespaces of its own (:mod:`lgt.trainer.rollout.sandbox`) from one zygote in a bubblewrap sandbox.

Its paths are the sandbox's: ``/lgt/work`` (also ``HOME``), its task at ``/lgt/work/.lgt/task.json``, the
proxy's CA copied there, the proxy at ``127.0.0.1`` (a loopback port relayed to its replica). Its work
folder's size is watched while it runs; the reward file it wrote is taken out of its folder without
following a link the agent made.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
from collections.abc import Sequence
from pathlib import Path

from lgt.proxy import auth
from lgt.store.files import write_atomic
from lgt.trainer.rollout import sandbox as sandboxing
from lgt.trainer.rollout.agent import STRIPPED_VARS, AgentSpec, RolloutError, expand, resolve_executable
from lgt.trainer.rollout.forkserver import ForkServerError
from lgt.trainer.rollout.runners.base import Attempt, Outcome
from lgt.trainer.rollout.runners.local import LocalRunner
from lgt.trainer.rollout.sandbox import SandboxError
from lgt.trainer.serving.children import signal_group


class SandboxedRunner(LocalRunner):
    """Attempts as local processes, each in a sandbox; ``hidden``: what no attempt may see (the store,
    the run directory, and what the owner hides)."""

    def __init__(self, agent: AgentSpec, *, run_dir: Path, kill_grace_s: float = 5.0,
                 hidden: Sequence[Path] = ()) -> None:
        super().__init__(agent, run_dir=run_dir, kill_grace_s=kill_grace_s, hidden=hidden)
        self.hidden = list(hidden)
        self._ca_pem: dict[int, bytes] = {}  # by proxy port: what each attempt gets a copy of

    @staticmethod
    def _check_sandbox(agent: AgentSpec) -> None:
        for path in agent.sandbox.mounts:
            if not path.exists():
                raise RolloutError(f"agent sandbox mount {str(path)!r} does not exist")
        try:
            sandboxing.check(agent.sandbox)
        except SandboxError as e:
            raise RolloutError(str(e)) from None

    # -- an attempt --------------------------------------------------------------------------------
    def place(self, a: Attempt, filename: str, data: bytes) -> str:
        a.files[filename] = data  # in the attempt's own folder (made before it starts)
        return f"{sandboxing.WORK}/.lgt/{filename}"

    def prepare(self, a: Attempt) -> None:
        lgt = f"{sandboxing.WORK}/.lgt"
        env = {k: v for k, v in os.environ.items() if k not in STRIPPED_VARS}
        env.pop("TMPDIR", None)
        env.update(HOME=sandboxing.WORK, LGT_WORK_DIR=sandboxing.WORK)
        proxy_env = a.proxy.rollout_env(a.rollout_id, a.attempt, self.agent.proxy_mode, greedy=a.greedy,
                                        host="127.0.0.1")
        env.update({k: f"{lgt}/ca.pem" if k in auth.CA_VARS else v for k, v in proxy_env.items()})
        env.update(a.fields)
        env.update(TASK_JSON=f"{lgt}/task.json", TASK_ID=a.task_id, REWARD_FILE=f"{lgt}/reward")
        env.update({k: expand(v, env, k) for k, v in self.agent.env.items()})
        env.update(a.extra_env)
        a.env = env
        a.work = self.work_root / a.name
        self._make_work(a)

    def _make_work(self, a: Attempt) -> None:
        """The attempt's own folder (``/lgt/work`` in its sandbox): its task, the proxy's CA, its resource
        files, owned by the sandbox's user."""
        assert a.work is not None
        work = a.work
        self.work_root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.work_root, 0o711)
        shutil.rmtree(work, ignore_errors=True)
        (work / ".lgt").mkdir(parents=True, mode=0o700)
        proxy = a.proxy
        if proxy.port not in self._ca_pem:  # the proxy's CA bundle, made and read once per run
            self._ca_pem[proxy.port] = Path(proxy.rollout_env(a.rollout_id, 0)["SSL_CERT_FILE"]).read_bytes()
        (work / ".lgt" / "task.json").write_bytes(a.agent_json)
        (work / ".lgt" / "ca.pem").write_bytes(self._ca_pem[proxy.port])
        for name, data in a.files.items():
            (work / ".lgt" / name).write_bytes(data)
        uid = sandboxing.sandbox_uid()
        if uid is not None:
            for path in (work, work / ".lgt", *(work / ".lgt").iterdir()):
                os.chown(path, uid, uid)
        os.chmod(work, 0o700)

    async def run(self, a: Attempt) -> Outcome:
        """Forked into its own namespaces, its loopback port relayed to its proxy, its work folder's size
        watched; the rest as a local process."""
        assert a.work is not None
        execute = self._preload is None
        argv = self.agent.command if execute else self.agent.command[1:]
        return await self._spawn(a, argv, {"work": a.work.name},
                                 name=self.agent.command[0], execute=execute, cwd=self.agent.cwd)

    async def _spawn(self, a: Attempt, argv: Sequence[str], request: dict, *, name: str, execute: bool,
                     cwd: Path | str | None, env: dict[str, str] | None = None, relay: bool = True,
                     out: tuple[Path, Path] | None = None) -> Outcome:
        """``argv`` forked from the zygote into namespaces of its own (``request``: what
        :mod:`~lgt.trainer.rollout.sandbox_init` is told besides the port, the folders the zygote keeps and
        the limits), until it exits or ``timeout_s`` passes. ``relay``: its loopback port relayed to its
        proxy (else nothing answers there), and its work folder's size watched."""
        assert a.work is not None
        spec = self.agent.sandbox
        proxy = a.proxy
        stdout, stderr = out or (a.paths.stdout, a.paths.stderr)
        try:
            server = await self._fork_server()
            req = {**request, "port": proxy.port, "keep": self._layout_keep,  # known once it started
                   "map_to": sandboxing.sandbox_uid(), **spec.limits()}
            proc = await server.spawn(argv, a.env if env is None else env, cwd, stdout, stderr,
                                      execute=execute, sandbox=req)
        except ForkServerError as e:
            return Outcome(None, False, f"could not start {name!r} in its sandbox: {e}")
        assert proc.listener is not None
        if not relay:
            proc.listener.close()
            return await self._wait(proc)
        relay_ = sandboxing.Relay(proxy.host, proxy.port)
        await relay_.start(proc.listener)
        limit = spec.disk_mb << 20
        over = asyncio.Event()
        work = a.work

        async def watch_disk() -> None:
            while True:
                await asyncio.sleep(0.5)
                if await asyncio.to_thread(sandboxing.disk_usage, work, limit) > limit:
                    over.set()
                    signal_group(proc.pid, signal.SIGKILL)
                    return

        watcher = asyncio.get_running_loop().create_task(watch_disk())
        try:
            outcome = await self._wait(proc)
        finally:
            watcher.cancel()
            relay_.close()
        if over.is_set():
            return Outcome(None, False, (f"the agent's work folder grew past its {spec.disk_mb} MB limit "
                                         "(agent.sandbox.disk_mb) and the attempt was killed"))
        return outcome

    def collect(self, a: Attempt) -> None:
        assert a.work is not None
        _take_reward_file(a.work, a.paths.reward_file)

    # -- the zygote --------------------------------------------------------------------------------
    def _layout(self, python: str) -> sandboxing.Layout:
        """What the sandbox shows: the interpreters, the agent's folder and the files its command names,
        ``agent.sandbox.mounts``; hidden: the store, the run directory and what the owner hides."""
        readonly = [*sandboxing.interpreter_dirs(python), *self.agent.sandbox.mounts]
        cmd = resolve_executable(self.agent.command[0], self.agent.cwd, os.environ.get("PATH"),
                                 "agent command")
        readonly += sandboxing.interpreter_dirs(cmd) if Path(cmd).parent.name == "bin" else [Path(cmd)]
        if self.agent.cwd is not None:
            readonly.append(self.agent.cwd.resolve())
        readonly += sandboxing.command_paths(self.agent.command[1:], self.agent.cwd)
        readonly = [Path(os.path.normpath(p.absolute())) for p in readonly]
        readonly += [p.resolve() for p in readonly if p.resolve() != p]  # what a link in them points to
        layout = sandboxing.Layout(readonly=readonly, hidden=list(self.hidden),
                                   attempts=self.work_root, cwd=self.agent.cwd)
        self.work_root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.work_root, 0o711)
        return layout


def _take_reward_file(work: Path, dest: Path, limit: int = 65536) -> None:
    """The reward file a sandboxed agent wrote (``/lgt/work/.lgt/reward``) to its place among the attempt's
    files, never following a link the agent made."""
    dest.unlink(missing_ok=True)
    try:
        top = os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            lgt = os.open(".lgt", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
            try:
                fd = os.open("reward", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=lgt)
            finally:
                os.close(lgt)
        finally:
            os.close(top)
    except OSError:
        return
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return
        write_atomic(dest, f.read(limit))
