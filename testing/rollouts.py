"""Rollouts in tests: the test agents' folder (``AGENTS``: small Python agents using the OpenAI SDK), the
proxy handle a rollout controller is given for a test's ``ProxyProc`` (``endpoint``), running jobs on a
controller (``run_all``), live processes by their command line (``running_with``), and reading what
the store holds afterwards (``rows``, ``attempts``, ``rewards``); ``gone`` tells whether a process no
longer runs.

The controller is imported only by the helpers that use it (the trainer's environment).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lgt.store.query import connect

if TYPE_CHECKING:
    from lgt.trainer.rollout.controller import RolloutController
    from lgt.trainer.serving.proxy import ProxyClient

AGENTS = Path(__file__).resolve().parents[1] / "tests" / "trainer" / "agents"  # testing/ sits beside tests/


def endpoint(proxy: Any) -> ProxyClient:
    from lgt.trainer.serving.proxy import ProxyClient

    return ProxyClient(store=proxy.store, port=proxy.port, api=proxy.client)


async def run_all(ctl: RolloutController, jobs: list[tuple[dict, str]], group: str = "g", step: int = 0):
    try:
        return await asyncio.gather(*(ctl.run(task, rid, group, step) for task, rid in jobs))
    finally:
        await ctl.aclose()


def rows(proxy: Any, sql: str, params: list | None = None) -> list[dict[str, Any]]:
    proxy.flush()
    con = connect(proxy.store)
    try:
        cur = con.execute(sql, params or [])
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]
    finally:
        con.close()


def attempts(proxy: Any, rid: str) -> list[dict[str, Any]]:
    return rows(proxy, "SELECT * FROM rollouts_log WHERE rollout_id = ? ORDER BY attempt", [rid])


def rewards(proxy: Any, rid: str) -> list[tuple[int, str, float]]:
    return [(r["attempt"], r["source"], r["value"]) for r in
            rows(proxy, "SELECT * FROM rewards_log WHERE rollout_id = ? ORDER BY attempt", [rid])]


def running_with(marker: str) -> list[int]:
    """The live processes whose command line holds ``marker`` (a daemon an attempt tried to leave)."""
    def cmdline(pid: str) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and not gone(int(p))
            and marker.encode() in cmdline(p)]


def gone(pid: int) -> bool:
    """The process no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")
