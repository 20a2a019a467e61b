"""The local runner's sandbox: every rollout attempt in namespaces of its own (bubblewrap), on by default.

One zygote per controller (:mod:`lgt.trainer.rollout.forkserver`) runs inside a ``bwrap`` sandbox that
sees the machine's system directories read-only, the agent's interpreter and the files the config
names (read-only), one folder of attempt work directories, and nothing else — not the store (its
secret and CA key), the run directory, the model, the tasks file or the config. It has no network
(only its own loopback) and, when lgt runs as root, the uid ``nobody`` outside. Each attempt is forked
from it into namespaces of its own (:mod:`lgt.trainer.rollout.sandbox_init`): pid, mount, network, IPC,
UTS and a nested user namespace, its own ``/work`` and ``/tmp``, and limits. The only way out of an
attempt's network namespace is a loopback port there that the controller relays to lgt-proxy
(:class:`Relay`), so the proxy's egress policy is the whole truth about what an agent reaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

SANDBOX_KINDS = ("bwrap", "none")
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
NOBODY = 65534
AGENT_UID = 1000  # an attempt's uid inside its sandbox (sandbox_init.py)
WORK = "/lgt/work"  # an attempt's own writable directory inside its sandbox (also its HOME)
ATTEMPTS = "/lgt/attempts"
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install "
                "bubblewrap), or set agent.sandbox: none in the run config to run agents without isolation")


class SandboxError(RuntimeError):
    """The sandbox cannot start here; one sentence naming what is missing and how to fix or turn it off."""


@dataclass(frozen=True)
class SandboxSpec:
    """``agent.sandbox``: ``bwrap`` (the default) or ``none``, and the limits of each attempt.

    ``mounts`` are more paths the agent needs (read-only, at the same path; relative to the agent's
    working folder); its command's interpreter, working directory and any file its command names are mounted
    without being listed. ``memory_mb`` bounds each process's data memory, ``processes`` the attempt's
    processes and threads, ``disk_mb`` its work directory (checked while it runs; no file may grow past
    it), ``tmp_mb`` its ``/tmp`` and ``/dev/shm``."""

    kind: str = "bwrap"
    memory_mb: int = 4096
    processes: int = 512
    disk_mb: int = 1024
    tmp_mb: int = 512
    mounts: tuple[Path, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.kind not in SANDBOX_KINDS:
            raise ValueError(f"agent sandbox must be one of {', '.join(SANDBOX_KINDS)}, not {self.kind!r}")
        for name in ("memory_mb", "processes", "disk_mb", "tmp_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"agent sandbox {name} must be a whole number ≥ 1, not {value!r}")
        object.__setattr__(self, "mounts", tuple(Path(m) for m in self.mounts))

    @property
    def on(self) -> bool:
        return self.kind != "none"

    def limits(self) -> dict[str, int]:
        mib = 1 << 20
        return {"memory_bytes": self.memory_mb * mib, "processes": self.processes,
                "file_bytes": self.disk_mb * mib, "tmp_bytes": self.tmp_mb * mib}


_checked: dict[str, str | None] = {}


def check(spec: SandboxSpec) -> None:
    """Refuse, before anything is built, a sandbox that cannot start here (bwrap missing, user
    namespaces off); one sentence. The probe runs once per process."""
    if not spec.on:
        return
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError(f"agent.sandbox is bwrap but bwrap is not on PATH: {INSTALL_HINT}")
    if bwrap not in _checked:
        probe = [bwrap, *_userns_args(), "--unshare-pid", "--unshare-net", "--unshare-ipc",
                 "--cap-add", "ALL", "--die-with-parent", *_system_binds(), "--proc", "/proc",
                 "--dev", "/dev", "--", "true"]
        try:
            done = subprocess.run(probe, capture_output=True, timeout=30)
            _checked[bwrap] = None if done.returncode == 0 else (
                done.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        except (OSError, subprocess.TimeoutExpired) as e:
            _checked[bwrap] = str(e)
    if _checked[bwrap] is not None:
        raise SandboxError(f"bwrap cannot make a sandbox here ({_checked[bwrap]}; unprivileged user "
                           f"namespaces may be off: sysctl kernel.unprivileged_userns_clone=1 or "
                           f"user.max_user_namespaces > 0): fix that, or set agent.sandbox: none")


def sandbox_uid() -> int | None:
    """The uid attempts run as outside: ``nobody`` when lgt runs as root (root's processes are not held
    to a process limit), else lgt's own user (None)."""
    return NOBODY if os.geteuid() == 0 else None


def _userns_args() -> list[str]:
    """lgt's own user: bwrap makes a user namespace where the zygote is uid 0. As root: none (the zygote
    stays root, so it can map each attempt to ``nobody``)."""
    return [] if os.geteuid() == 0 else ["--unshare-user", "--uid", "0", "--gid", "0"]


def _system_binds() -> list[str]:
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    return args


def plain_python() -> str:
    """An interpreter for a zygote that only forks and execs: the system's, else this one."""
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def interpreter_dirs(executable: str) -> list[Path]:
    """What an interpreter needs visible: its environment (a venv's folder) and its installation."""
    path = Path(executable).absolute()
    dirs = []
    if (path.parent.parent / "pyvenv.cfg").exists():
        dirs += [path.parent.parent, path.parent.parent.resolve()]  # (the name it is run by may be a link)
    real = path.resolve()
    dirs.append(real.parent.parent if real.parent.name == "bin" else real.parent)
    return dirs


@dataclass
class Layout:
    """What one zygote's sandbox sees: read-only paths, paths hidden inside them, the attempts' folder."""

    readonly: list[Path]
    hidden: list[Path]
    attempts: Path
    cwd: Path | None
    writable: list[Path] = field(default_factory=list)

    def keep(self) -> list[str]:
        """The mounted paths under /tmp, which each attempt's own /tmp must not cover (outermost only)."""
        under = sorted({p for p in [*self.readonly, *self.writable]
                        if Path("/tmp") in p.parents and p.exists()}, key=lambda p: len(p.parts))
        kept: list[Path] = []
        for p in under:
            if not any(k in p.parents for k in kept):
                kept.append(p)
        return [str(p) for p in kept]

    def argv(self, bwrap: str) -> tuple[list[str], list[int]]:
        """bwrap's arguments and the descriptors they name (paths are opened here, by lgt's user, and
        bound by descriptor)."""
        fds: list[int] = []

        def fd(path: Path) -> str:
            fds.append(os.open(path, os.O_PATH | os.O_CLOEXEC))
            os.set_inheritable(fds[-1], True)
            return str(fds[-1])

        args = [bwrap, *_userns_args(), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--cap-add", "ALL", "--hostname", "lgt-sandbox",
                *_system_binds(), "--proc", "/proc", "--dev", "/dev",
                "--tmpfs", "/tmp", "--perms", "0755", "--dir", "/lgt", "--perms", "0755", "--dir", WORK]
        system = [Path(d) for d in SYSTEM_DIRS]
        made: set[Path] = set()
        for path in sorted(set(self.readonly), key=lambda p: len(p.parts)):
            if any(path == s or s in path.parents for s in system) or not path.exists() \
                    or any(r in path.parents for r in self.readonly):  # seen through a folder above it
                continue
            for parent in reversed(path.parents[:-1]):  # folders on the way, searchable by the agent
                if parent not in made and not any(parent == s or s in parent.parents for s in system):
                    made.add(parent)
                    if not any(r == parent or r in parent.parents for r in self.readonly if r != path):
                        args += ["--perms", "0755", "--dir", str(parent)]
            args += ["--ro-bind-fd", fd(path), str(path)]
        for path in self.writable:
            args += ["--bind-fd", fd(path), str(path)]
        args += ["--bind-fd", fd(self.attempts), ATTEMPTS]
        for path in self.hidden:
            if not any(path == r or r in path.parents for r in self.readonly):
                continue
            if path.is_dir():
                args += ["--tmpfs", str(path)]
            elif path.exists():
                args += ["--ro-bind", "/dev/null", str(path)]
        if self.cwd is not None:
            args += ["--chdir", str(self.cwd)]
        return args, fds


def command_paths(command: Sequence[str], cwd: Path | None) -> list[Path]:
    """Files the agent's command names (its script, say), to mount read-only: any argument that is an
    existing path relative to the working directory, or absolute."""
    found = []
    for arg in command:
        if not arg or arg.startswith("-"):
            continue
        p = Path(arg) if Path(arg).is_absolute() or cwd is None else cwd / arg
        with contextlib.suppress(OSError):
            if p.exists():
                found.append(p.absolute())
    return found


# -- the relay: an attempt's loopback port → lgt-proxy ------------------------------------------------
class _Pipe(asyncio.Protocol):
    """One side of a relayed connection: what it receives goes to its peer (held until the peer is
    connected)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.pending: list[bytes] = []
        self.eof = self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)
        else:
            self.pending.append(data)

    def eof_received(self) -> bool:
        if self.peer is not None and self.peer.transport is not None:
            if self.peer.transport.can_write_eof():
                self.peer.transport.write_eof()
        else:
            self.eof = True
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class Relay:
    """Accepts on an attempt's listening socket (inside its network namespace) and joins each
    connection to lgt-proxy at ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, listener: socket.socket) -> None:
        self.server = await asyncio.get_running_loop().create_server(self._inbound, sock=listener)

    def _inbound(self) -> _Pipe:
        inbound = _Pipe()
        task = asyncio.get_running_loop().create_task(self._connect(inbound))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return inbound

    async def _connect(self, inbound: _Pipe) -> None:
        loop = asyncio.get_running_loop()
        outbound = _Pipe()
        outbound.peer, inbound.peer = inbound, outbound
        try:
            await loop.create_connection(lambda: outbound, self.host, self.port)
        except OSError:
            if inbound.transport is not None:
                inbound.transport.close()
            return
        assert outbound.transport is not None
        for data in inbound.pending:
            outbound.transport.write(data)
        inbound.pending.clear()
        if inbound.closed:
            outbound.transport.close()
        elif inbound.eof and outbound.transport.can_write_eof():
            outbound.transport.write_eof()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._tasks):
            task.cancel()


def disk_usage(path: Path, limit: int) -> int:
    """Bytes under ``path`` (stops counting past ``limit``)."""
    total = 0
    stack = [str(path)]
    while stack and total <= limit:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        else:
                            total += entry.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        continue
        except OSError:
            continue
    return total
