"""The proxy's metrics: the counters and histograms the addons keep, and their Prometheus text
(the control API's ``GET /metrics``).

Everything here runs on the proxy's single asyncio loop, so plain counters need no locks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


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


class GateGauges(Protocol):
    """What the metrics read of the pause gate (:class:`lgt.proxy.gate.Gate`)."""

    in_flight: int
    held: int
    policy_version: int
    hold: Histogram

    @property
    def paused(self) -> bool: ...


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

    def prometheus(self, gate: GateGauges, rows_written: int) -> str:
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
