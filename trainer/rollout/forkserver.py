"""A fork server for Python agents: one rollout = one forked process that starts warm.

A Python agent spends most of a short rollout importing its libraries (the OpenAI SDK alone costs ~1 s of
CPU here). With ``agent.python_preload: [openai]`` the controller starts the agent's own interpreter
once as a zygote (``zygote.py``) that imports those modules, and forks it per rollout: each rollout is
still its own process and process group, with its own environment, working directory, stdout/stderr
files and exit status, running the agent's script as ``__main__`` — the agent does not change.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import struct
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lgt.trainer.serving.children import signal_group

if TYPE_CHECKING:
    from lgt.trainer.rollout.sandbox import Layout

ZYGOTE = Path(__file__).with_name("zygote.py")


class ForkServerError(RuntimeError):
    """The fork server could not start, or died."""


class ForkedProcess:
    """What ``asyncio.subprocess.Process`` offers the controller: ``pid``, ``returncode``, ``wait()``."""

    def __init__(self, pid: int, done: asyncio.Future[int]) -> None:
        self.pid = pid
        self._done = done
        self.listener: socket.socket | None = None  # sandboxed: the attempt's loopback port, to relay

    @property
    def returncode(self) -> int | None:
        return self._done.result() if self._done.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._done)


class ForkServer:
    """``await ForkServer.start(python, modules)``, then ``await spawn(argv, env, cwd, stdout, stderr)``."""

    def __init__(self, proc: asyncio.subprocess.Process, learn_dir: str | None = None,
                 control: socket.socket | None = None) -> None:
        self.proc = proc
        self.learn_dir = learn_dir  # where the first children list their modules (``auto``); ours to remove
        self._ids = itertools.count(1)
        self._started: dict[int, asyncio.Future[int]] = {}
        self._exited: dict[int, asyncio.Future[int]] = {}
        self._ready: dict[int, asyncio.Future[tuple[int, socket.socket]]] = {}
        self.loop = asyncio.get_running_loop()
        self._reader = self.loop.create_task(self._read())
        self.control = control  # sandboxed: requests go here with their files; attempts answer here
        # sandboxed attempts being set up at once: a unix socket holds only a few unread messages
        self._starting = asyncio.Semaphore(8)
        if control is not None:
            control.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            asyncio.get_running_loop().add_reader(control.fileno(), self._read_control)

    @classmethod
    async def start(cls, python: str, modules: Sequence[str], timeout: float = 120,
                    env: Mapping[str, str] | None = None,
                    sandbox: Layout | None = None) -> ForkServer:
        """``modules`` may include ``auto``: learn the rest from the first rollouts (see zygote.py);
        none: a zygote that only forks and execs. ``env`` is the zygote's own environment (each child
        gets exactly its request's). ``sandbox``: the zygote runs in a bubblewrap sandbox of that
        layout, and each attempt in namespaces of its own (:mod:`lgt.trainer.rollout.sandbox`)."""
        env = dict(os.environ if env is None else env)
        named = [m for m in modules if m != "auto"]
        # The learning folder is made and removed here, not by the zygote: a zygote stopped by a signal
        # (aclose's SIGTERM, a SIGKILL) runs no clean-up of its own.
        learn_dir = tempfile.mkdtemp(prefix="lgt-zygote-") if "auto" in modules else None
        argv = [python, "-u", str(ZYGOTE)]
        kwargs: dict = {}
        control = theirs = None
        fds: list[int] = []
        try:
            if sandbox is not None:
                from lgt.trainer.rollout import sandbox as sb
                control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                theirs.set_inheritable(True)
                if learn_dir:
                    sandbox.writable.append(Path(learn_dir))
                    if sb.sandbox_uid() is not None:
                        os.chown(learn_dir, sb.sandbox_uid(), sb.sandbox_uid())
                bwrap, fds = sandbox.argv(shutil.which("bwrap") or "bwrap")
                for name in (ZYGOTE, ZYGOTE.with_name("sandbox_init.py")):
                    fds.append(os.open(name, os.O_RDONLY | os.O_CLOEXEC))
                    bwrap += ["--ro-bind-fd", str(fds[-1]), f"/lgt/{name.name}"]
                argv = [*bwrap, "--", python, "-u", "/lgt/zygote.py", "--sandbox", str(theirs.fileno())]
                kwargs = {"pass_fds": (*fds, theirs.fileno())}
            proc = await asyncio.create_subprocess_exec(
                *argv, *(["--learn", learn_dir] if learn_dir else []), *named,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True, **kwargs)
            for fd in fds:
                os.close(fd)
            fds = []
            if theirs is not None:
                theirs.close()
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
            for fd in fds:
                os.close(fd)
            for sock in (control, theirs):
                if sock is not None:
                    sock.close()
            if learn_dir:
                shutil.rmtree(learn_dir, ignore_errors=True)
            raise
        asyncio.get_running_loop().create_task(_drain(proc.stderr))
        return cls(proc, learn_dir, control)

    async def _send(self, msg: bytes, fds: list[int]) -> None:
        """One request on the control socket without blocking the event loop: while the zygote is busy
        (a burst of rollouts fills the socket), this loop must go on relaying the running attempts."""
        assert self.control is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                self.control.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))],
                                     socket.MSG_DONTWAIT)
                return
            except BlockingIOError:
                writable = loop.create_future()
                loop.add_writer(self.control.fileno(), _wake, writable)
                try:
                    await writable
                finally:
                    loop.remove_writer(self.control.fileno())

    def _read_control(self) -> None:
        """An attempt's answer from inside its sandbox: ready (its listening socket, and its pid as this
        process sees it, from the kernel's credentials) or the reason its namespaces failed."""
        assert self.control is not None
        while True:
            try:
                msg, anc, _, _ = self.control.recvmsg(1 << 16, socket.CMSG_SPACE(16) + socket.CMSG_SPACE(12),
                                                      socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                msg, anc = b"", []
            if not msg:
                asyncio.get_running_loop().remove_reader(self.control.fileno())
                return
            fds, pid = [], None
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += array.array("i", data[: len(data) - len(data) % 4]).tolist()
                elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("iII", data[:12])[0]
            body = json.loads(msg)
            fut = self._ready.pop(body.get("id"), None)
            if fut is None or fut.done() or pid is None or (body.get("ready") and len(fds) != 1):
                for fd in fds:
                    os.close(fd)
                if pid is not None and (fut is None or fut.done()):  # its spawn() gave up: no one watches it
                    _kill_child(pid)
                if fut is not None and not fut.done():
                    fut.set_exception(ForkServerError("the sandboxed attempt sent a malformed answer"))
                continue
            if body.get("ready"):
                fut.set_result((pid, socket.socket(fileno=fds[0])))
            else:
                for fd in fds:
                    os.close(fd)
                fut.set_exception(ForkServerError(str(body.get("error") or "the attempt did not start")))

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
        for fut in [*self._started.values(), *self._exited.values(), *self._ready.values()]:
            if not fut.done():
                fut.set_exception(err)
                fut.exception()  # retrieved: only waiters that are still there need to see it

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | os.PathLike | None,
                    stdout: str | os.PathLike, stderr: str | os.PathLike, *, execute: bool = False,
                    sandbox: Mapping | None = None) -> ForkedProcess:
        """Fork a child running ``argv`` (a Python script, or with ``execute`` any program). Sandboxed
        (``sandbox``: the attempt's work folder name, port and limits) the child is in namespaces of its
        own, and its listening socket is ``.listener`` of the result."""
        if self.proc.returncode is not None:
            raise ForkServerError(f"the fork server exited (code {self.proc.returncode})")
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        started, exited = loop.create_future(), loop.create_future()
        self._exited[rid] = exited
        req = {"id": rid, "argv": list(argv), "env": dict(env), "cwd": str(cwd) if cwd else None,
               "stdout": str(stdout), "stderr": str(stderr), "exec": execute}
        if self.control is not None:
            async with self._starting:
                req["sandbox"] = dict(sandbox or {})
                ready = self._ready[rid] = loop.create_future()
                files = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                         for p in (stdout, stderr)]
                try:
                    await self._send(json.dumps(req).encode(), files)
                except OSError as e:
                    self._ready.pop(rid, None)
                    self._exited.pop(rid, None)
                    raise ForkServerError(f"the sandbox's zygote does not answer ({e.strerror or e})") \
                        from None
                finally:
                    for fd in files:
                        os.close(fd)
                try:
                    pid, listener = await asyncio.wait_for(asyncio.shield(ready), 60)
                except (TimeoutError, asyncio.CancelledError) as e:
                    self._ready.pop(rid, None)
                    ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen: no warning
                    if isinstance(e, asyncio.CancelledError):
                        raise
                    raise ForkServerError("the sandboxed attempt did not start within 60 s") from None
                proc = ForkedProcess(pid, exited)
                proc.listener = listener
                return proc
        self._started[rid] = started
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        await self.proc.stdin.drain()
        pid = await started
        return ForkedProcess(pid, exited)

    def abandon(self) -> None:
        """Kill the zygote at once, from outside its event loop (which has ended: a controller used
        again under a new ``asyncio.run``)."""
        signal_group(self.proc.pid, signal.SIGKILL)
        if self.control is not None:
            self.control.close()
        if self.learn_dir:
            shutil.rmtree(self.learn_dir, ignore_errors=True)

    async def aclose(self) -> None:
        if self.proc.returncode is None:
            signal_group(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 5)
            if self.proc.returncode is None:
                signal_group(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        self._reader.cancel()
        if self.control is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self.control.fileno())
            self.control.close()
        if self.learn_dir:
            shutil.rmtree(self.learn_dir, ignore_errors=True)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _kill_child(pid: int) -> None:
    """SIGKILL a forked child and its process group (it may not have made its own group yet)."""
    signal_group(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


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
