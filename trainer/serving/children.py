"""The processes lgt starts and watches — its engine, a proxy, a teacher, and the servers its tests and
benchmarks run — started, waited for and stopped one way.

A child that may start children of its own (vLLM's engine core, an agent's helpers) runs in a session of
its own (``start_new_session=True``): its process group is then everything it started, which
:func:`stop` ends together (SIGTERM, then SIGKILL); ``preexec_fn=die_with_parent`` has the kernel send it
SIGTERM when this process dies, so nothing outlives a crash. :func:`wait_until` polls a readiness check
until it passes, the child exits or time runs out; :func:`log_tail` puts the last lines of its log in the
error that says which. :func:`free_port` picks its port.

The standard library only: imported in every environment (the proxy's has no torch).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 20
KILL_WAIT_S = 10.0  # how long a SIGKILLed child is waited for


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """True when a TCP server could bind ``host:port`` now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listens(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections on ``host:port`` now."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def die_with_parent() -> None:
    """In a child before exec (``preexec_fn``): get SIGTERM when the parent dies (Linux), so nothing
    outlives a crash."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen, timeout: float, every: float = 0.1) -> bool:
    """Call ``ready()`` every ``every`` s until it is true (True), or until ``proc`` exits or ``timeout`` s
    pass (False: ``proc.returncode`` is set when it exited)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            return False
        if ready():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(every)


def log_tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of the text file ``path`` ('' when there is none or it cannot be read)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to the process group ``pgid``; nothing when it is gone (or not ours to signal)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _exists(send: Callable[[int, int], None], ident: int) -> bool:
    """Whether signal 0 by ``send`` (os.kill, os.killpg) finds ``ident`` (another user's counts)."""
    try:
        send(ident, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def alive(pid: int) -> bool:
    """Whether the process ``pid`` exists (a zombie counts until it is reaped)."""
    return _exists(os.kill, pid)


def group_alive(pgid: int) -> bool:
    """Whether a process of the group ``pgid`` is left (a zombie counts until it is reaped)."""
    return _exists(os.killpg, pgid)


def wait_exit(proc: subprocess.Popen, timeout: float, *, group: bool = True) -> bool:
    """Wait until ``proc`` has exited (reaped) and, ``group``, no process of its group is left; False when
    ``timeout`` s pass first."""
    if not group:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    deadline = time.monotonic() + timeout
    while True:
        proc.poll()
        if proc.returncode is not None and not group_alive(proc.pid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def kill(proc: subprocess.Popen, *, group: bool = True, timeout: float = KILL_WAIT_S) -> bool:
    """SIGKILL ``proc`` — ``group``: its whole process group (it leads one: ``start_new_session``) — and
    wait up to ``timeout`` s until it is gone (:func:`wait_exit`)."""
    if group:
        signal_group(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGKILL)  # nothing once it has been reaped
    return wait_exit(proc, timeout, group=group)


def stop(proc: subprocess.Popen, timeout: float = 30.0, *, group: bool = True,
         name: str | None = None) -> bool:
    """Stop ``proc``: SIGTERM, then :func:`kill` when it has not exited after ``timeout`` s. ``group``: the
    signals go to its whole process group (it leads one: ``start_new_session``), and it has exited once no
    process of the group is left. True when SIGTERM was enough; ``name``: a warning says when it was not."""
    if group:
        signal_group(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    if wait_exit(proc, timeout, group=group):
        return True
    if name is not None:
        log.warning("%s (pid %d) did not stop in %.0f s after SIGTERM: killing it", name, proc.pid, timeout)
    kill(proc, group=group)
    return False
