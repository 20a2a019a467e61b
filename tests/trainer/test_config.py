"""The run config: examples load, every bad key or value is one sentence naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lgt.trainer import config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(ROOT.glob("examples/*/run.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.parent.name)
def test_examples_load(path: Path) -> None:
    cfg = config.load(path)
    assert cfg.agent.command and cfg.tasks.is_file()
    assert cfg.model.path.is_absolute()
    assert len(config.load_tasks(cfg.tasks)) >= 100


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "a", "question": "q"}\n')
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


BASE = "agent: {command: [python, agent.py]}\ntasks: tasks.jsonl\nmodel: {path: m}\n"


def test_minimal_defaults_and_paths(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, BASE))
    assert cfg.mode == "async" and cfg.group_size == 8 and cfg.name == tmp_path.name
    assert cfg.tasks == tmp_path / "tasks.jsonl" and cfg.model.path == tmp_path / "m"
    assert json.loads(json.dumps(cfg.to_json()))["agent"]["command"] == ["python", "agent.py"]


def test_overrides(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, BASE), {"mode": "sync", "backend.lr": 0.01, "agent.retries": 0,
                                              "max_samples": 640})
    assert (cfg.mode, cfg.backend.lr, cfg.agent.retries, cfg.max_samples) == ("sync", 0.01, 0, 640)


@pytest.mark.parametrize("extra, message", [
    ("mode: fast\n", "mode must be one of sync, async, not 'fast'"),
    ("grup_size: 4\n", "unknown key grup_size"),
    ("backend: {lrr: 1}\n", "unknown key backend.lrr"),
    ("group_size: four\n", "group_size must be an integer, not 'four'"),
    ("backend: {lr: -1}\n", "backend.lr must be positive"),
    ("max_inflight: 2\n", "max_inflight (2) must hold at least one group (8 rollouts)"),
    ("agent: {command: []}\n", "agent.command is required"),
    ("agent: {command: x, proxy_mode: socks}\n", "agent.proxy_mode must be one of https_proxy, base_url"),
    ("algorithm: {sample_mode: fuzzy}\n", "algorithm.sample_mode must be one of exact, realign"),
    ("engine: 3\n", "engine must be a mapping"),
    ("proxy: {url: 'localhost:1'}\n", "proxy.url must be the control API's http(s) URL"),
    ("algorithm: {std_normalize: 'yes'}\n", "algorithm.std_normalize must be true or false"),
])
def test_bad_values_name_the_key(tmp_path: Path, extra: str, message: str) -> None:
    text = BASE.replace("agent: {command: [python, agent.py]}\n", "") if extra.startswith("agent") else BASE
    with pytest.raises(config.ConfigError) as e:
        config.load(write(tmp_path, text + extra))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_required_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match="tasks is required"):
        config.load(write(tmp_path, "agent: {command: x}\nmodel: {path: m}\n"))
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.yaml")
    with pytest.raises(config.ConfigError, match=r"not valid YAML \(line 2\)"):
        config.load(write(tmp_path, "a: 1\n b: [\n"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "a"}\nnot json\n')
    with pytest.raises(config.ConfigError, match="line 2 is not JSON"):
        config.load_tasks(bad)
    bad.write_text('{"task_id": "a"}\n{"task_id": "a"}\n')
    with pytest.raises(config.ConfigError, match="task_id 'a' appears twice"):
        config.load_tasks(bad)
    bad.write_text("")
    with pytest.raises(config.ConfigError, match="holds no tasks"):
        config.load_tasks(bad)
