"""Claude Code, unmodified, with its sub-agents on a policy of their own (examples/claude_code/policies.yaml).

The example's own task.sh and environment, its own ``policies`` section, one real ``lgt-proxy`` with that
section (``--policies``) and a scripted engine (the fake vLLM, :mod:`lgt.testing.fake_upstream`) that
plays a model which hands the task to a sub-agent: the main conversation calls Claude Code's Agent tool,
the sub-agent (Claude Code's own sub-agent loop, its own system prompt) runs the shell command that
writes the word, and the main conversation ends. Every call of the main conversation must be recorded
under ``main`` and sent to main's served model, every call of the sub-agent under ``side`` and sent to
side's; the task's own check gives reward 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from lgt.testing.fake_upstream import FakeUpstream
from lgt.testing.harness_policy import Answer, ScriptedPolicy, find_task, has_tool_result
from lgt.testing.proxy import ProxyProc

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "examples" / "claude_code"
CLAUDE = HERE / "node_modules" / ".bin" / "claude"
SUBAGENT = "You are an agent for Claude Code"  # Claude Code's sub-agent system prompt begins so


def _texts(body: dict[str, Any], roles: tuple[str, ...]) -> list[str]:
    out = []
    for m in body.get("messages") or []:
        if m.get("role") in roles:
            c = m.get("content")
            out.append(c if isinstance(c, str) else "\n".join(p.get("text", "") for p in c or []
                                                               if isinstance(p, dict)))
    return out


class Delegating(ScriptedPolicy):
    """The main conversation hands the task to a sub-agent and waits for it; the sub-agent does it (the
    scripted policy's shell call, then its final text)."""

    def answer(self, body: dict[str, Any]) -> Answer:
        tools = [t.get("function", {}).get("name") for t in body.get("tools") or []]
        if "Agent" in tools and not any(SUBAGENT in s for s in _texts(body, ("system",))):
            if has_tool_result("chat", body):
                return Answer("final", "The sub-agent did it.", body)
            task = next(t for t in _texts(body, ("user",)) if find_task([t]) is not None)
            args = {"description": "Write the word", "prompt": task, "subagent_type": "general-purpose",
                    "run_in_background": False}
            return Answer("tool-call", ("Agent", json.dumps(args)), body)
        return super().answer(body)


@pytest.mark.slow
@pytest.mark.skipif(not CLAUDE.exists(), reason="Claude Code is not installed in examples/claude_code "
                                                "(bash scripts/setup_agent.sh examples/claude_code)")
def test_claude_codes_sub_agent_calls_go_to_their_own_policy(tmp_path: Path) -> None:
    cfg = yaml.safe_load((HERE / "policies.yaml").read_text())
    served = {"main": "main-v0", "side": "side-v0"}  # what lgt-train run names each policy's adapter
    section = [{**p, "served": served[p["name"]]} for p in cfg["policies"]]
    (tmp_path / "policies.json").write_text(json.dumps(section))
    task = json.loads((ROOT / "examples" / "write_a_word" / "tasks.jsonl").read_text().splitlines()[0])
    (tmp_path / "task.json").write_text(json.dumps(task))
    policy = Delegating()
    with FakeUpstream.in_thread(reply=policy, max_model_len=1 << 20) as engine:
        proxy = ProxyProc(tmp_path / "store", engine.url, "--egress", "deny",
                          "--policies", str(tmp_path / "policies.json")).start()
        try:
            env = {**os.environ, **cfg["agent"]["env"], **proxy.env("r1"), "TMPDIR": str(tmp_path),
                   "TASK_PROMPT": task["prompt"], "TASK_JSON": str(tmp_path / "task.json")}
            r = subprocess.run(["bash", str(HERE / "task.sh")], env=env, capture_output=True, text=True,
                               timeout=240, cwd=tmp_path)
            settle = time.monotonic() + 10
            while proxy.client.state()["in_flight"] and time.monotonic() < settle:
                time.sleep(0.05)
            rows = proxy.calls("rollout_id = ?", ["r1"])
        finally:
            proxy.stop()
    why = f"rc={r.returncode}\nstdout: {r.stdout[-1500:]}\nstderr: {r.stderr[-1500:]}\nrows: " + str(
        [(c["policy"], c["served_model"], c["status"]) for c in rows])
    assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])["reward"] == 1.0, why
    kinds = [a.kind for a in policy.answers]
    assert kinds.count("tool-call") >= 2 and "final" in kinds, why  # the Agent call, the sub-agent's shell
    assert len(rows) == len(policy.answers) and all(c["status"] == "ok" for c in rows), why
    by_policy: dict[str, list[dict[str, Any]]] = {"main": [], "side": []}
    for c in rows:
        body = json.loads(c["request_json"])
        sub = SUBAGENT in json.dumps(body.get("system"))
        by_policy[c["policy"]].append(c)
        assert c["policy"] == ("side" if sub else "main"), why  # the rule, on what Claude Code sent
        assert c["served_model"] == served[c["policy"]], why
    assert len(by_policy["main"]) >= 2 and len(by_policy["side"]) >= 2, why
    # the engine was asked for each policy's own model
    asked = [a.request["model"] for a in policy.answers]
    assert sorted(asked) == sorted(c["served_model"] for c in rows), why
