"""The subprocesses a benchmark starts and watches: ``Procs`` starts each (in its own session, killed with
this process, without the machine's proxy variables), waits until it listens, and stops them all;
``rss_mb`` reads a process's resident memory."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

DROP_ENV = ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "ALL_PROXY", "all_proxy")


def _die_with_parent() -> None:  # children get SIGTERM even if this script is SIGKILLed
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Procs:
    """The benchmark's subprocesses; ``stop_all`` (SIGTERM, then SIGKILL) runs on any exit."""

    def __init__(self, logdir: Path) -> None:
        self.logdir, self.procs = logdir, []
        self.env = {k: v for k, v in os.environ.items() if k not in DROP_ENV}

    def start(self, name: str, argv: list[str], port: int) -> int:
        """Start ``argv``, wait until it listens on ``port``, return its pid."""
        with open(self.logdir / f"{name}.log", "wb") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                 stdin=subprocess.DEVNULL, start_new_session=True,
                                 preexec_fn=_die_with_parent)  # noqa: PLW1509 (no threads yet)
        self.procs.append(p)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and p.poll() is None:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return p.pid
            time.sleep(0.05)
        tail = (self.logdir / f"{name}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{name} did not start listening on port {port}:\n{tail}")

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def rss_mb(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())[1]) / 1024
