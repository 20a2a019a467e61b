"""The pause gate and the proxy's metrics: shared state between the addons and the control API.

Everything here runs on the proxy's single asyncio loop, so plain counters need no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

HOLD = "hold"
REJECT = "reject"
ORPHAN_CHECK_S = 0.25  # how often a pause looks for in-flight calls whose agent has gone
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Rejected(Exception):
    """A new LLM call arrived while paused in reject mode."""


class Gate:
    """Holds new LLM calls while paused and tracks the ones in flight.

    ``enter()`` is awaited by every LLM call before it is forwarded; ``exit()`` is called exactly
    once when it completes (response delivered, error, or disconnect). ``pause()`` closes the gate
    and returns once nothing is in flight; ``resume(version)`` sets the policy version that calls
    forwarded from then on are recorded with, and releases the held ones.
    """

    def __init__(self, mode: str = HOLD, policy_version: int = 0) -> None:
        if mode not in (HOLD, REJECT):
            raise ValueError(f"pause mode must be {HOLD!r} or {REJECT!r}, not {mode!r}")
        self.mode = mode
        self.policy_version = policy_version
        self.in_flight = 0
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

    async def pause(self, timeout: float | None = None,
                    orphaned: Callable[[], int] = lambda: 0) -> tuple[bool, int, float]:
        """Close the gate and wait for in-flight calls: (drained, in_flight_at_pause, seconds).
        ``orphaned()`` counts calls whose agent has gone (its connection closed): nobody waits for
        their answer, so once only those are left the pause is drained (they are recorded when they end)."""
        if not self.paused:
            self._open.clear()
            self.paused_at = time.monotonic()
            self.pauses += 1
        at_pause = self.in_flight
        t0 = time.monotonic()
        deadline = math.inf if timeout is None else t0 + timeout
        while self.in_flight > orphaned():
            left = deadline - time.monotonic()
            if left <= 0:
                return False, at_pause, time.monotonic() - t0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), min(ORPHAN_CHECK_S, left))
        return True, at_pause, time.monotonic() - t0

    def resume(self, policy_version: int | None = None) -> None:
        if policy_version is not None:
            self.policy_version = policy_version
        self.paused_at = None
        self._open.set()


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += value
        self.n += 1
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out += [f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return out


@dataclass
class Metrics:
    calls: dict[str, int] = field(default_factory=dict)  # by status
    latency: Histogram = field(default_factory=Histogram)
    ttfb: Histogram = field(default_factory=Histogram)
    drain: Histogram = field(default_factory=Histogram)
    rejected: int = 0
    bad_requests: int = 0
    # observe-only: requests on an LLM API's path whose body could not be read, passed through unrecorded
    passed_unread: int = 0
    blocked_egress: int = 0
    auth_failures: int = 0
    record_failures: int = 0
    degraded_captures: dict[str, int] = field(default_factory=dict)  # ok calls, by capture_reason
    started: float = field(default_factory=time.time)

    def count(self, status: str) -> None:
        self.calls[status] = self.calls.get(status, 0) + 1

    def degraded(self, reason: str) -> None:
        self.degraded_captures[reason] = self.degraded_captures.get(reason, 0) + 1

    def prometheus(self, gate: Gate, rows_written: int) -> str:
        lines = [
            "# HELP lgt_proxy_calls_total LLM calls recorded, by status.",
            "# TYPE lgt_proxy_calls_total counter",
        ]
        for status, n in sorted(self.calls.items()):
            lines.append(f'lgt_proxy_calls_total{{status="{status}"}} {n}')
        lines += [
            "# HELP lgt_proxy_degraded_captures_total Successful calls recorded without full token "
            "capture, by reason.",
            "# TYPE lgt_proxy_degraded_captures_total counter",
        ]
        for reason, n in sorted(self.degraded_captures.items()):
            lines.append(f'lgt_proxy_degraded_captures_total{{reason="{reason}"}} {n}')
        errors = sum(n for s, n in self.calls.items() if s != "ok")
        for name, kind, help_, value in (
            ("lgt_proxy_errors_total", "counter", "Recorded calls whose status is not ok.", errors),
            ("lgt_proxy_rejected_total", "counter", "Calls answered 429 while paused.", self.rejected),
            ("lgt_proxy_bad_requests_total", "counter", "LLM-path requests answered 400/413.",
             self.bad_requests),
            ("lgt_proxy_passed_unread_total", "counter",
             "LLM-path requests passed through unread and unrecorded (observe-only).", self.passed_unread),
            ("lgt_proxy_egress_blocked_total", "counter", "Requests blocked by the egress policy.",
             self.blocked_egress),
            ("lgt_proxy_auth_failures_total", "counter", "Requests answered 407/401.",
             self.auth_failures),
            ("lgt_proxy_record_failures_total", "counter", "Calls that could not be recorded.",
             self.record_failures),
            ("lgt_proxy_store_rows_total", "counter", "Rows appended to the store.", rows_written),
            ("lgt_proxy_in_flight", "gauge", "LLM calls forwarded and not finished.", gate.in_flight),
            ("lgt_proxy_held", "gauge", "LLM calls held by the pause gate.", gate.held),
            ("lgt_proxy_paused", "gauge", "1 while paused.", int(gate.paused)),
            ("lgt_proxy_policy_version", "gauge", "Policy version new calls are served under.",
             gate.policy_version),
        ):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        for name, hist, help_ in (
            ("lgt_proxy_latency_seconds", self.latency, "LLM call latency."),
            ("lgt_proxy_ttfb_seconds", self.ttfb, "Time to the upstream's first response byte."),
            ("lgt_proxy_drain_seconds", self.drain, "Seconds a pause waited for in-flight calls."),
            ("lgt_proxy_hold_seconds", gate.hold, "Seconds a call held by a pause waited for the resume."),
        ):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *hist.lines(name)]
        return "\n".join(lines) + "\n"
