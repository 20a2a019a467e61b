"""A fork server for Python agents: one rollout = one forked process that starts warm.

A Python agent spends most of a short rollout importing its libraries (the OpenAI SDK alone costs ~1 s of
CPU here). With ``agent.python_preload: [openai]`` the controller starts the agent's own interpreter
once as a zygote (``zygote.py``) that imports those modules, and forks it per rollout: each rollout is
still its own process and process group, with its own environment, working directory, stdout/stderr
files and exit status, running the agent's script as ``__main__`` — the agent does not change.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

ZYGOTE = Path(__file__).with_name("zygote.py")


class ForkServerError(RuntimeError):
    """The fork server could not start, or died."""


class ForkedProcess:
    """What ``asyncio.subprocess.Process`` offers the controller: ``pid``, ``returncode``, ``wait()``."""

    def __init__(self, pid: int, done: asyncio.Future[int]) -> None:
        self.pid = pid
        self._done = done

    @property
    def returncode(self) -> int | None:
        return self._done.result() if self._done.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._done)


class ForkServer:
    """``await ForkServer.start(python, modules)``, then ``await spawn(argv, env, cwd, stdout, stderr)``."""

    def __init__(self, proc: asyncio.subprocess.Process, learn_dir: str | None = None) -> None:
        self.proc = proc
        self.learn_dir = learn_dir  # where the first children list their modules (``auto``); ours to remove
        self._ids = itertools.count(1)
        self._started: dict[int, asyncio.Future[int]] = {}
        self._exited: dict[int, asyncio.Future[int]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def start(cls, python: str, modules: Sequence[str], timeout: float = 120,
                    env: Mapping[str, str] | None = None) -> ForkServer:
        """``modules`` may include ``auto``: learn the rest from the first rollouts (see zygote.py).
        ``env`` is the zygote's own environment (each child gets exactly its request's)."""
        env = dict(os.environ if env is None else env)
        named = [m for m in modules if m != "auto"]
        # The learning folder is made and removed here, not by the zygote: a zygote stopped by a signal
        # (aclose's SIGTERM, a SIGKILL) runs no clean-up of its own.
        learn_dir = tempfile.mkdtemp(prefix="lgt-zygote-") if "auto" in modules else None
        try:
            proc = await asyncio.create_subprocess_exec(
                python, "-u", str(ZYGOTE), *(["--learn", learn_dir] if learn_dir else []), *named,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), timeout)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise ForkServerError(f"the fork server ({python}) did not import {', '.join(modules)} "
                                      f"within {timeout:.0f} s") from None
            msg = json.loads(line) if line.strip() else {}
            if not msg.get("ready"):
                err = msg.get("error") or (await proc.stderr.read()).decode(errors="replace").strip()[-500:]
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
                raise ForkServerError(f"the fork server ({python}) could not start: {err}")
        except BaseException:
            if learn_dir:
                shutil.rmtree(learn_dir, ignore_errors=True)
            raise
        asyncio.get_running_loop().create_task(_drain(proc.stderr))
        return cls(proc, learn_dir)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            msg = json.loads(line)
            rid = msg.get("id")
            if "pid" in msg and rid in self._started:
                started = self._started.pop(rid)
                if started.done():  # its spawn() was cancelled: no one will wait for or stop this child
                    _kill_child(msg["pid"])
                else:
                    started.set_result(msg["pid"])
            elif "exit" in msg and rid in self._exited:
                exited = self._exited.pop(rid)
                if not exited.done():
                    exited.set_result(msg["exit"])
        err = ForkServerError(f"the fork server exited (code {await self.proc.wait()})")
        for fut in [*self._started.values(), *self._exited.values()]:
            if not fut.done():
                fut.set_exception(err)
                fut.exception()  # retrieved: only waiters that are still there need to see it

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | os.PathLike | None,
                    stdout: str | os.PathLike, stderr: str | os.PathLike) -> ForkedProcess:
        if self.proc.returncode is not None:
            raise ForkServerError(f"the fork server exited (code {self.proc.returncode})")
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        started, exited = loop.create_future(), loop.create_future()
        self._started[rid], self._exited[rid] = started, exited
        req = {"id": rid, "argv": list(argv), "env": dict(env), "cwd": str(cwd) if cwd else None,
               "stdout": str(stdout), "stderr": str(stderr)}
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        await self.proc.stdin.drain()
        pid = await started
        return ForkedProcess(pid, exited)

    async def aclose(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 5)
            if self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        self._reader.cancel()
        if self.learn_dir:
            shutil.rmtree(self.learn_dir, ignore_errors=True)


def _kill_child(pid: int) -> None:
    """SIGKILL a forked child and its process group (it may not have made its own group yet)."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


async def _drain(stream: asyncio.StreamReader | None) -> None:
    if stream is not None:
        while await stream.read(65536):
            pass


def python_script_command(command: Sequence[str]) -> tuple[str, list[str]] | None:
    """(interpreter, [script, args...]) when ``command`` runs a Python script (``python x.py ...``)."""
    if len(command) < 2:
        return None
    exe = os.path.basename(command[0])
    if not exe.startswith("python") or command[1].startswith("-"):
        return None
    return command[0], list(command[1:])
