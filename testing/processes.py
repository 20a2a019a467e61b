"""The subprocesses a benchmark starts and watches: ``Procs`` starts each (in its own session, killed with
this process, without the machine's proxy variables), waits until it listens, and stops them all;
``rss_mb`` reads a process's resident memory."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from lgt.trainer.serving import children

DROP_ENV = ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "ALL_PROXY", "all_proxy")


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
                                 preexec_fn=children.die_with_parent)  # noqa: PLW1509 (no threads yet)
        self.procs.append(p)
        if children.wait_until(lambda: children.listens(port), p, 30, every=0.05):
            return p.pid
        tail = (self.logdir / f"{name}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{name} did not start listening on port {port}:\n{tail}")

    def stop_all(self) -> None:
        for p in self.procs:
            children.stop(p, 10)  # its whole session's group


def rss_mb(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())[1]) / 1024
