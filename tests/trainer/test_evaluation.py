"""Held-out evaluation's pure parts: the config, the split, one evaluation over a fake controller."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from lgt.trainer import config as cfgmod
from lgt.trainer.run import evaluation
from lgt.trainer.run.evaluation import EvalConfig, held_out, split_tasks

ROOT = Path(__file__).resolve().parents[2]
TASKS = [{"task_id": f"t{i}", "question": f"q{i}"} for i in range(200)]


def test_the_split_is_a_fixed_share_the_same_for_every_run() -> None:
    train, held = split_tasks(TASKS, EvalConfig(split=0.2))
    assert 25 <= len(held) <= 55 and len(train) + len(held) == 200  # ~20% of 200, by hash
    assert not {t["task_id"] for t in train} & {t["task_id"] for t in held}
    assert split_tasks(list(reversed(TASKS)), EvalConfig(split=0.2))[1] == list(reversed(held))
    # a bigger share holds out a superset: raising eval.split never moves a task back into training
    wider = split_tasks(TASKS, EvalConfig(split=0.4))[1]
    assert {t["task_id"] for t in held} <= {t["task_id"] for t in wider}
    assert [t["task_id"] for t in held] == [t["task_id"] for t in TASKS if held_out(t["task_id"], 0.2)]
    _, few = split_tasks(TASKS, EvalConfig(split=0.2, max_tasks=5))
    assert few == held[:5]
    assert split_tasks(TASKS, None) == (TASKS, [])


def test_a_held_out_file_must_not_share_a_task_with_training() -> None:
    train, held = split_tasks(TASKS[:10], EvalConfig(tasks=Path("h.jsonl")), TASKS[10:20])
    assert train == TASKS[:10] and held == TASKS[10:20]
    with pytest.raises(ValueError, match="task 't3' is in both the tasks file and eval.tasks"):
        split_tasks(TASKS[:10], EvalConfig(tasks=Path("h.jsonl")), TASKS[3:5])


@pytest.mark.parametrize("kw, message", [
    ({}, "exactly one of tasks"),
    ({"split": 0.2, "tasks": Path("x")}, "exactly one of tasks"),
    ({"split": 1.0}, "eval.split must be between 0 and 1"),
    ({"split": 0.2, "every": -1}, "eval.every must be 0 or more"),
    ({"split": 0.2, "greedy": False, "samples": 0}, "runs nothing"),
    ({"split": 0.2, "max_tasks": 0}, "eval.max_tasks must be at least 1"),
])
def test_bad_eval_settings_are_one_sentence(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EvalConfig(**kw)


def test_the_run_config_reads_the_eval_section(tmp_path: Path) -> None:
    src = (ROOT / "examples/arith/run.yaml").read_text()
    (tmp_path / "run.yaml").write_text(src)
    (tmp_path / "tasks.jsonl").write_text((ROOT / "examples/arith/tasks.jsonl").read_text())
    cfg = cfgmod.load(tmp_path / "run.yaml", {"eval": {"split": 0.3, "every": 5, "samples": 4}})
    assert cfg.eval == EvalConfig(split=0.3, every=5, samples=4)
    cfg = cfgmod.load(tmp_path / "run.yaml", {"eval": {"tasks": "held.jsonl"}})
    assert cfg.eval.tasks == tmp_path / "held.jsonl"  # relative to the YAML file
    with pytest.raises(cfgmod.ConfigError, match="unknown key eval.evry"):
        cfgmod.load(tmp_path / "run.yaml", {"eval": {"split": 0.2, "evry": 5}})
    with pytest.raises(cfgmod.ConfigError, match="eval.split must be between 0 and 1"):
        cfgmod.load(tmp_path / "run.yaml", {"eval": {"split": 2}})


def test_due_steps() -> None:
    assert [s for s in range(25) if EvalConfig(split=0.1, every=10).due(s)] == [0, 10, 20]
    assert [s for s in range(25) if EvalConfig(split=0.1, every=0).due(s)] == [0]


def test_one_evaluation_runs_greedy_and_sampled_rollouts_and_leaves_failures_out() -> None:
    calls = []

    async def run_rollout(task, rollout_id, group_id, step, *, split, greedy=False):
        calls.append((rollout_id, group_id, step, split, greedy))
        if task["task_id"] == "t2" and not greedy:
            return SimpleNamespace(ok=False, reward=None)  # failed after its retries
        reward = 1.0 if greedy else (0.5 if rollout_id.endswith("s0") else 0.0)
        return SimpleNamespace(ok=True, reward=reward)

    res = asyncio.run(evaluation.evaluate(EvalConfig(split=0.2, samples=2), TASKS[:3], run_rollout,
                                          step=10, version=10))
    assert len(calls) == 9 and all(c[2:4] == (10, "eval") for c in calls)
    assert [c for c in calls if c[4]] == [(f"e000010-0000{i}-g", f"e000010-0000{i}", 10, "eval", True)
                                         for i in range(3)]
    assert res.greedy == [1.0, 1.0, 1.0] and res.sampled == [0.5, 0.0, 0.5, 0.0]  # t2's samples failed
    row = res.row(time_s=12.5)
    assert row["eval/reward_greedy"] == 1.0 and row["eval/reward_sampled"] == 0.25
    assert (row["eval/rollouts"], row["eval/failed"], row["step"], row["version"]) == (9, 2, 10, 10)
    assert "greedy 1.000" in res.line() and "sampled 0.250" in res.line()
    assert json.loads(json.dumps(row)) == row


@pytest.mark.parametrize("args, message", [
    (["--set", "eval=null"], "the run config has no eval section to say which tasks are held out"),
    (["--checkpoint", "{tmp}"], "holds no finished checkpoint: give a run's folder or one of its "
                                "checkpoints/step-N folders"),
    (["--set", "eval.split=1.5"], "eval.split must be between 0 and 1"),
])
def test_lgt_train_eval_refuses_bad_input_before_starting_anything(tmp_path: Path, args: list,
                                                                    message: str) -> None:
    from click.testing import CliRunner

    from lgt.trainer.cli import main

    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    run_dir = tmp_path / "out"
    config_file = str(ROOT / "examples/arith/run.yaml")
    result = CliRunner().invoke(main, ["eval", config_file, "--run-dir", str(run_dir), *args])
    assert result.exit_code == 1 and message in " ".join(result.output.split()), result.output
    assert not run_dir.exists()  # nothing started, nothing written
