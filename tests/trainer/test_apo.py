"""lgt-train apo's beam search (trainer/apo/optimize.py) with real rollouts through the proxy and a scripted
critic on 127.0.0.1: it finds the instruction the agent's reward needs, placeholders survive, a critic
that answers garbage, drops a placeholder or times out costs one candidate, and a restart scores no
finished candidate again."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from lgt.testing.rollouts import AGENTS, endpoint
from lgt.testing.scripted_critic import SEED, ScriptedCritic
from lgt.trainer.apo import optimize as apo
from lgt.trainer.rollout.agent import AgentSpec
from lgt.trainer.rollout.controller import RolloutController
from lgt.trainer.rollout.resources import Resources, ResourceSpec


@pytest.fixture
def critic():
    with ScriptedCritic() as url:
        yield apo.Critic(apo.CriticConfig(timeout_s=0.5), url)


def search(tmp_path, proxy) -> tuple[Resources, RolloutController, apo.Runner]:
    """The starting prompt (a ``deliver: env`` resource), the controller running prompt_agent.py, and
    the optimiser's rollout runner."""
    (tmp_path / "prompt.txt").write_text(SEED)
    start = Resources({"system_prompt": ResourceSpec(tmp_path / "prompt.txt", "env")})
    # sandbox none: these tests drive one controller from several asyncio.run calls (a stand-in for a
    # restart), and a sandbox's zygote lives on the event loop that started it
    agent = AgentSpec(command=(sys.executable, str(AGENTS / "prompt_agent.py")), timeout_s=60, retries=0,
                      sandbox="none")
    ctl = RolloutController(agent, endpoint(proxy), proxy.store, tmp_path / "run", 8, batch_records=True)
    return start, ctl, apo.make_runner(ctl, proxy.store)


def tasks(n: int, prefix: str) -> list[dict]:
    return [{"task_id": f"{prefix}{i}", "question": f"What is {i} plus {i}?"} for i in range(n)]


def test_beam_finds_the_instruction_and_resumes_without_scoring_again(tmp_path, proxy, critic):
    start, ctl, run = search(tmp_path, proxy)
    train, val = tasks(4, "tr"), tasks(3, "va")
    cfg = apo.ApoConfig(rounds=1, beam_width=2, branch_factor=2, batch_size=3, val_size=3, target_reward=1.0)

    async def go(c: apo.ApoConfig):
        return await apo.beam(c, start, run, train, val, critic, tmp_path / "run", log=lambda _: None)

    try:
        first = asyncio.run(go(cfg))  # one round, then "killed": a restart continues the search
        assert first["val_reward"] == 0.0
        scored_before = sum(1 for r in apo.Ledger(tmp_path / "run").rows if r["event"] == "score"
                            and r["split"] == "val")
        best = asyncio.run(go(apo.ApoConfig(**{**cfg.__dict__, "rounds": 3})))
    finally:
        asyncio.run(ctl.aclose())
    assert best["val_reward"] == 1.0 and best["round"] == 2
    assert best["text"] == "Solve {question}. Be polite. Answer in one word."  # the placeholder kept
    assert (tmp_path / "run" / "apo" / "best_prompt.txt").read_text() == best["text"]
    rows = apo.Ledger(tmp_path / "run").rows
    val_scores = [r["version"] for r in rows if r["event"] == "score" and r["split"] == "val"]
    assert len(val_scores) == len(set(val_scores)) and scored_before == 2  # nothing scored twice
    reasons = sorted(r["reason"] for r in rows if r["event"] == "rejected")
    assert reasons == ["the critic gave no usable answer", "the critic gave no usable answer",
                       "the rewrite drops the placeholder(s) {question}"]  # empty, timed out, DROP
    assert critic.failures == 2
    table = apo.table(tmp_path / "run")
    assert [c["val_reward"] for c in table][:1] == [1.0] and {c["round"] for c in table} == {0, 1, 2}
    svg = apo.plot(tmp_path / "run").read_text()
    assert svg.startswith("<svg") and "validation reward per round" in svg


def test_a_search_killed_mid_round_resumes_without_scoring_again(tmp_path, proxy, critic):
    start, ctl, run = search(tmp_path, proxy)
    calls = {"n": 0}

    async def dies_on_the_fifth_batch(res, batch, tag):
        calls["n"] += 1
        if calls["n"] == 5:  # round 2, after its first critique's rollouts were scored: "kill -9"
            raise KeyboardInterrupt
        return await run(res, batch, tag)

    cfg = apo.ApoConfig(rounds=3, beam_width=2, branch_factor=2, batch_size=3, val_size=3, target_reward=1.0)
    args = (tasks(4, "tr"), tasks(3, "va"), critic, tmp_path / "run")
    try:
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(apo.beam(cfg, start, dies_on_the_fifth_batch, *args, log=lambda _: None))
        before = [r for r in apo.Ledger(tmp_path / "run").rows if r["event"] == "score"]
        best = asyncio.run(apo.beam(cfg, start, run, *args, log=lambda _: None))
    finally:
        asyncio.run(ctl.aclose())
    assert best["val_reward"] == 1.0
    val = [r["version"] for r in apo.Ledger(tmp_path / "run").rows if r["event"] == "score"
           and r["split"] == "val"]
    assert len(val) == len(set(val)) and len(before) >= 3  # each candidate validated once, across the kill


def test_gepa_finds_it_too_through_the_gepa_library(tmp_path, proxy, critic):
    start, ctl, run = search(tmp_path, proxy)
    cfg = apo.ApoConfig(optimizer="gepa", rounds=3, beam_width=2, branch_factor=2, batch_size=3, val_size=3,
                        target_reward=1.0)

    async def go():
        try:
            return await apo.optimize(cfg, start, run, tasks(4, "tr"),
                                      tasks(3, "va"), critic, tmp_path / "run", log=lambda _: None)
        finally:
            await ctl.aclose()

    best = asyncio.run(go())
    assert best["val_reward"] == 1.0 and best["text"] == "Solve {question}. Answer in one word."
    rows = apo.Ledger(tmp_path / "run").rows
    assert any("drops the placeholder" in r.get("reason", "") for r in rows if r["event"] == "rejected")
    assert critic.failures >= 1  # the empty and the timed-out answers cost their candidates only
    assert (tmp_path / "run" / "apo" / "best_prompt.txt").read_text() == best["text"]


@pytest.mark.slow
def test_lgt_train_apo_end_to_end(tmp_path, arith_model_dir, arith_engine, critic):
    """``lgt-train apo``: vLLM serving the model (the session's engine, ``engine.url``), the real proxy,
    the agent's prompt a resource, the scripted critic — the table, the best prompt and the plot; a second
    call with --resume scores nothing again."""
    import yaml

    from lgt.testing.runs import lgt_train_cmd

    (tmp_path / "prompt.txt").write_text(SEED)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks(12, "t")))
    cfg = {"name": "apo", "model": {"path": str(arith_model_dir)}, "tasks": str(tmp_path / "tasks.jsonl"),
           "agent": {"command": [sys.executable, str(AGENTS / "prompt_agent.py")], "timeout_s": 60,
                     "retries": 0},
           "resources": {"system_prompt": {"template": str(tmp_path / "prompt.txt"), "deliver": "env"}},
           "apo": {"rounds": 2, "beam_width": 2, "branch_factor": 2, "batch_size": 4, "val_size": 4,
                   "critic": {"base_url": critic.base_url, "model": "critic", "timeout_s": 0.5}},
           "engine": {"max_model_len": 256, "url": arith_engine.url}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = lgt_train_cmd("apo", str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run"), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "best: " in out.stdout and "validation reward 1.000" in out.stdout, out.stdout
    assert (tmp_path / "run" / "apo" / "best_prompt.txt").read_text() == \
        "Solve {question}. Be polite. Answer in one word."
    assert (tmp_path / "run" / "apo" / "rounds.svg").exists()
    report = (tmp_path / "run" / "report.html").read_text()
    assert "Prompt optimisation" in report and "Answer in one word." in report and "<svg" in report
    scores = sum(1 for r in apo.Ledger(tmp_path / "run").rows if r["event"] == "score")
    again = lgt_train_cmd("apo", str(tmp_path / "run.yaml"), "--resume", str(tmp_path / "run"), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sum(1 for r in apo.Ledger(tmp_path / "run").rows if r["event"] == "score") == scores
