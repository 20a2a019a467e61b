"""lgt-train report: the numbers behind the page, and the page itself."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from lgt.store.query import connect
from lgt.store.report import report_data, write_report
from lgt.store.writer import TableWriter

T0 = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


def make_store(root: Path) -> None:
    """Two steps of two rollouts each; step 0 on policy version 0, step 1 on version 1."""
    rewards = {("s0a", 0): 0.0, ("s0b", 0): 0.5, ("s1a", 1): 1.0, ("s1b", 1): 0.5}
    with TableWriter(root, "calls") as calls, TableWriter(root, "rollouts") as rollouts, \
            TableWriter(root, "rewards") as rw:
        for (rid, step), value in rewards.items():
            for seq in range(2):
                degraded = rid == "s1b" and seq == 1
                calls.append({"call_id": f"{rid}-{seq}", "rollout_id": rid, "attempt": 0,
                              "seq": seq, "started_at": T0, "endpoint": "chat/completions",
                              "policy_version": step, "streamed": False, "status": "ok",
                              "usage_total_tokens": 10,
                              "capture": "no_logprobs" if degraded else "full",
                              "capture_reason": "upstream_rejected_logprobs" if degraded else None})
            rollouts.append({"rollout_id": rid, "attempt": 0, "task_id": "t", "step": step,
                             "group_id": f"g{step}", "status": "ok", "recorded_at": T0})
            rw.append({"reward_id": rid, "rollout_id": rid, "attempt": 0, "value": value,
                       "source": "cli", "recorded_at": T0})
        calls.append({"call_id": "bad", "rollout_id": "s1a", "attempt": 0, "seq": 2,
                      "started_at": T0, "endpoint": "chat/completions", "policy_version": 1,
                      "streamed": False, "status": "http_error"})
        for i in range(2):  # refused by the proxy itself: on the record, counted by reason
            calls.append({"call_id": f"refused{i}", "rollout_id": "s1a", "attempt": 0, "seq": 3 + i,
                          "started_at": T0, "endpoint": "chat/completions", "api": "messages",
                          "policy_version": 1, "streamed": False, "status": "rejected", "http_status": 413,
                          "error": f"request body of {900 + i} bytes exceeds the proxy's limit"})
        calls.append({"call_id": "fitted", "rollout_id": "s1b", "attempt": 0, "seq": 2, "started_at": T0,
                      "endpoint": "chat/completions", "policy_version": 1, "streamed": False,
                      "status": "ok", "capture": "full",
                      "translation": ["max_tokens 128000 is more than the engine's context of 512 tokens",
                                      "thinking ignored"]})
    with TableWriter(root, "egress") as egress:
        for i, (host, allowed) in enumerate([("pypi.org", True), ("pypi.org", True),
                                             ("telemetry.invalid", False)]):
            egress.append({"egress_id": f"e{i}", "rollout_id": "s0a", "attempt": 0, "started_at": T0,
                           "kind": "http", "host": host, "allowed": allowed, "policy": "allowlist"})


def test_report_numbers(tmp_path: Path) -> None:
    make_store(tmp_path)
    data = report_data(connect(tmp_path))
    assert data["reward_per_step"] == [(0.0, 0.25, 2), (1.0, 0.75, 2)]
    assert data["call_status"] == [("ok", 9), ("rejected", 2), ("http_error", 1)]
    assert data["staleness"] == [(0, 5), (1, 4)]  # ok calls only
    assert data["totals"] == {"calls": 12, "rollouts": 4, "rewarded_rollouts": 4, "tokens": 80}
    assert data["capture"] == [("full", 8), ("no_logprobs (upstream_rejected_logprobs)", 1)]
    assert data["refused"] == [("413 request body of N bytes exceeds the proxy's limit", 2)]
    assert data["approximated"] == [("max_tokens N is more than the engine's context of N tokens", 1),
                                    ("thinking ignored", 1)]
    assert data["egress"] == [("pypi.org", True, 2), ("telemetry.invalid", False, 1)]


def test_report_page_is_written_whole(tmp_path: Path) -> None:
    make_store(tmp_path / "store")
    out = tmp_path / "report.html"
    write_report(connect(tmp_path / "store"), out, title="run 7")
    page = out.read_text()
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    for heading in ("Reward per step", "Samples per rollout", "Merge breaks", "Staleness",
                    "Calls by status", "Refused calls", "Approximated in translation", "Token capture",
                    "Egress"):
        assert f"<h2>{heading}</h2>" in page
    assert page.count("<svg") >= 3 and "step 0: 0.250" in page and "step 1: 0.750" in page
    assert "telemetry.invalid (blocked): 1" in page
    assert "<td class=n>2</td><td>413 request body of N bytes exceeds the proxy&#x27;s limit</td>" in page
    assert not list(tmp_path.glob(".*.tmp"))


def test_report_of_an_empty_store(tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    data = write_report(connect(tmp_path), out, title="empty")
    assert data["totals"] == {"calls": 0, "rollouts": 0, "rewarded_rollouts": 0, "tokens": 0}
    assert "nothing recorded yet" in out.read_text()
