"""The pause gate: shared state between the Hold addon and the control API.

Everything here runs on the proxy's single asyncio loop, so plain counters need no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable

from .metrics import Histogram

HOLD = "hold"
REJECT = "reject"
DRAIN = "drain"  # --on-update: a pause waits for the calls in flight to finish
CONTINUE = "continue"  # … stops them where they are; the proxy continues each on the new weights
ON_UPDATE = (DRAIN, CONTINUE)
ORPHAN_CHECK_S = 0.25  # how often a pause looks for in-flight calls whose agent has gone


class Rejected(Exception):
    """A new LLM call arrived while paused in reject mode."""


class Gate:
    """Holds new LLM calls while paused and tracks the ones in flight.

    ``enter()`` is awaited by every LLM call before it is forwarded; ``exit()`` is called exactly
    once when it completes (response delivered, error, or disconnect). ``pause()`` closes the gate
    and returns once nothing is in flight; ``resume(version)`` sets the policy version that calls
    forwarded from then on are recorded with, and releases the held ones.
    """

    def __init__(self, mode: str = HOLD, policy_version: int = 0, on_update: str = DRAIN) -> None:
        if mode not in (HOLD, REJECT):
            raise ValueError(f"pause mode must be {HOLD!r} or {REJECT!r}, not {mode!r}")
        if on_update not in ON_UPDATE:
            raise ValueError(f"on_update must be {DRAIN!r} or {CONTINUE!r}, not {on_update!r}")
        self.mode = mode
        self.on_update = on_update
        self.policy_version = policy_version
        self.in_flight = 0
        # calls that can be stopped at a pause and continued after it (continuation.py): call id -> stop
        self.stoppable: dict[str, Callable[[], None]] = {}
        self.parked = 0  # of in_flight: stopped at this pause, waiting for the resume to go on
        self.stopped_total = 0  # calls stopped at a pause and continued after it, since start
        self._changed = asyncio.Event()  # a call ended or parked: a pause looks again
        self.continuing = False  # the current pause stops stoppable calls (on_update continue)
        self.held = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.paused_at: float | None = None
        self.pauses = 0
        self.hold = Histogram()  # seconds each held call waited for the resume

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def enter(self) -> int:
        """Wait while paused (or raise Rejected); returns the policy version the call runs under."""
        waited_since = None
        while not self._open.is_set():
            if self.mode == REJECT:
                raise Rejected()
            waited_since = waited_since or time.monotonic()
            self.held += 1
            try:
                await self._open.wait()
            finally:
                self.held -= 1
        if waited_since is not None:
            self.hold.observe(time.monotonic() - waited_since)
        self.in_flight += 1
        self._idle.clear()
        return self.policy_version

    def exit(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle.set()
        self._changed.set()

    def stoppable_call(self, call_id: str, stop: Callable[[], None]) -> None:
        """``stop()`` stops the call's exchange at a pause that continues calls (at once if one is on);
        the call parks (``park``) and goes on after the resume. Undone by ``not_stoppable``."""
        self.stoppable[call_id] = stop
        if self.paused and self.continuing:
            stop()

    def not_stoppable(self, call_id: str) -> None:
        self.stoppable.pop(call_id, None)

    async def park(self) -> int:
        """A stopped call waits here for the resume (counted as parked, so the pause need not wait
        for it); returns the policy version it goes on under."""
        self.parked += 1
        self.stopped_total += 1
        self._changed.set()
        try:
            await self._open.wait()
        finally:
            self.parked -= 1
        return self.policy_version

    async def pause(self, timeout: float | None = None, orphaned: Callable[[], int] = lambda: 0,
                    on_update: str | None = None) -> tuple[bool, int, float]:
        """Close the gate and wait for in-flight calls: (drained, in_flight_at_pause, seconds).
        ``orphaned()`` counts calls whose agent has gone (its connection closed): nobody waits for
        their answer, so once only those are left the pause is drained (they are recorded when they end).
        ``on_update`` (default: the gate's): ``continue`` stops every stoppable call where it is
        instead of waiting for it (it parks until the resume, then goes on); the others drain."""
        if not self.paused:
            self._open.clear()
            self.paused_at = time.monotonic()
            self.pauses += 1
        at_pause = self.in_flight
        t0 = time.monotonic()
        self.continuing = (on_update or self.on_update) == CONTINUE
        if self.continuing:
            for stop in list(self.stoppable.values()):
                stop()
        deadline = math.inf if timeout is None else t0 + timeout
        while self.in_flight - self.parked > orphaned():
            left = deadline - time.monotonic()
            if left <= 0:
                return False, at_pause, time.monotonic() - t0
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(ORPHAN_CHECK_S, left))
        return True, at_pause, time.monotonic() - t0

    def resume(self, policy_version: int | None = None) -> None:
        if policy_version is not None:
            self.policy_version = policy_version
        self.paused_at = None
        self.continuing = False
        self._open.set()
