"""Prompt resources (trainer/rollout/resources.py): templates filled per task, delivered by the proxy (system
message), as a variable or as a file; every rollout records the version it ran with."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from lgt.testing.rollouts import AGENTS, endpoint, rows, run_all
from lgt.trainer import config
from lgt.trainer.rollout.agent import AgentSpec
from lgt.trainer.rollout.controller import RolloutController
from lgt.trainer.rollout.resources import (
    Resources,
    ResourceSpec,
    check_rewrite,
    env_name,
    fill,
    placeholders,
    version,
)


def test_templates_fill_from_the_task_and_keep_other_braces() -> None:
    t = 'Solve {question} (difficulty {level}). Reply as JSON: {"answer": N}. {unknown} stays.'
    assert placeholders(t) == {"question", "level", "unknown"}
    assert fill(t, {"question": "2+3", "level": 2}) == \
        'Solve 2+3 (difficulty 2). Reply as JSON: {"answer": N}. {unknown} stays.'
    check_rewrite("Solve {question}.", "Think, then solve {question}.")
    with pytest.raises(ValueError, match=r"the rewrite drops the placeholder\(s\) \{question\}"):
        check_rewrite("Solve {question}.", "Solve it.")
    assert version({"a": "x", "b": "y"}) == version({"b": "y", "a": "x"}) != version({"a": "x", "b": "z"})
    assert env_name("system-prompt") == "LGT_RESOURCE_SYSTEM_PROMPT"


def test_the_run_config_names_its_resources(tmp_path: Path) -> None:
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "a", "question": "q"}\n')
    (tmp_path / "prompt.txt").write_text("Solve {question}.")
    base = "agent: {command: [python, agent.py]}\ntasks: tasks.jsonl\nmodel: {path: m}\n"
    (tmp_path / "run.yaml").write_text(base + "resources: {system_prompt: {template: prompt.txt}, "
                                              "hint: {template: prompt.txt, span: ['<<H>>', '<</H>>']}}\n")
    cfg = config.load(tmp_path / "run.yaml")
    assert cfg.resources["system_prompt"] == ResourceSpec(tmp_path / "prompt.txt", "proxy", None)
    assert cfg.resources["hint"].span == ("<<H>>", "<</H>>")
    for bad, message in [("{template: p.txt, deliver: mail}", "deliver must be one of proxy, env, file"),
                         ("{template: p.txt, deliver: env, span: [a, b]}", "span is two non-empty markers")]:
        (tmp_path / "run.yaml").write_text(base + f"resources: {{x: {bad}}}\n")
        with pytest.raises(config.ConfigError, match=message):
            config.load(tmp_path / "run.yaml")


def test_rollouts_get_their_resources_and_record_the_version(tmp_path, proxy, upstream):
    for name, text in {"prompt.txt": "Solve {question} exactly.", "notes.txt": "Notes for {task_id}.",
                       "guide.txt": "A guide."}.items():
        (tmp_path / name).write_text(text)
    res = Resources({"system_prompt": ResourceSpec(tmp_path / "prompt.txt"),
                     "notes": ResourceSpec(tmp_path / "notes.txt", "env"),
                     "guide": ResourceSpec(tmp_path / "guide.txt", "file")})
    agent = AgentSpec(command=(sys.executable, str(AGENTS / "chat_agent.py")), timeout_s=60, retries=0,
                      sandbox="none")  # the agent reports to the test's folder
    ctl = RolloutController(agent, endpoint(proxy), proxy.store, tmp_path / "run", 4, resources=res)
    tasks = [({"task_id": f"p{i}", "question": f"{i}+1", "report_dir": str(tmp_path),
               "rewards": {"stdout": i / 2}}, f"res-{i}") for i in range(2)]

    results = asyncio.run(run_all(ctl, tasks, "g000001"))
    assert [r.status for r in results] == ["ok", "ok"]
    assert {r.resource_version for r in results} == {res.version}
    chats = [r for r in upstream.requests if r.method == "POST"]  # the proxy also reads the model card
    systems = [r.body["messages"][0] for r in chats if r.body["messages"][-1]["content"] in ("0+1", "1+1")]
    assert sorted(m["content"] for m in systems) == ["Solve 0+1 exactly.", "Solve 1+1 exactly."]
    assert all(m["role"] == "system" for m in systems)  # put first: the agent sent none
    seen = json.loads((tmp_path / "res-1~0.json").read_text())["env"]
    assert seen["LGT_RESOURCE_NOTES"] == "Notes for p1."
    assert Path(seen["LGT_RESOURCE_GUIDE_FILE"]).read_text() == "A guide."
    by_version = rows(proxy, "SELECT r.resource_version, count(*) AS n, avg(w.value) AS reward "
                             "FROM rollouts r JOIN rewards w USING (rollout_id, attempt) "
                             "WHERE r.rollout_id LIKE 'res-%' GROUP BY 1")
    assert by_version == [{"resource_version": res.version, "n": 2, "reward": 0.25}]
