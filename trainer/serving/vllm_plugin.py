"""lgt's vLLM plugin (entry point ``vllm.general_plugins``: vLLM calls :func:`register` in each of its
processes — API server, engine core, workers — whatever starts them). It does nothing unless the
engine was started by lgt with ``LGT_VLLM_IDLE_SPIN_S`` set (see ``EngineConfig.idle_spin_s``).

What it changes: vLLM's processes hand each step to one another through shared-memory queues, and a
reader that has just read a message busy-waits (``sched_yield`` in a loop) for the next one for 1 s
before it sleeps on a socket. During training every gap between requests — agents starting, the
trainer's update — is shorter than that, so on CPU the engine core and its worker kept a core
spinning for most of a run (half their samples under a profiler), a core the agents, the proxy and
the trainer needed. ``LGT_VLLM_IDLE_SPIN_S`` shortens that window; the hot path (the next message
arriving within it) still never sleeps. 0 (sleep at once) was slower: every hand-off then waited
for a wake-up on a loaded machine.
"""

from __future__ import annotations

import logging
import os

ENV = "LGT_VLLM_IDLE_SPIN_S"
log = logging.getLogger("vllm.lgt")  # under vLLM's logger: its handler writes it to the engine log


def idle_spin_s(env: dict[str, str] | os._Environ = os.environ) -> float | None:
    """The window asked for in ``env`` (None when unset or not a number >= 0)."""
    try:
        value = float(env.get(ENV, ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def register() -> None:
    window = idle_spin_s()
    if window is None:
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return
    cond = getattr(shm_broadcast, "SpinCondition", None)
    wait = getattr(cond, "wait", None)
    if cond is None or wait is None or getattr(wait, "lgt_window", None) is not None:
        return  # another vLLM (nothing to patch) or already patched in this process

    def patched(self, timeout_ms=None):
        if getattr(self, "is_reader", False):
            self.busy_loop_s = window
        return wait(self, timeout_ms)

    patched.lgt_window = window
    cond.wait = patched
    log.info("lgt: vLLM readers busy-wait at most %g s for the next message (pid %d)", window, os.getpid())
