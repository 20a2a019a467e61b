"""The run config: examples load, every bad key or value is one sentence naming it."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from lgt.trainer import config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(ROOT.glob("examples/*/*.yaml"))  # run.yaml, and the distill configs beside them


# examples whose tasks file a user writes first (its README): from these SWE-bench instances, by
# `lgt-train tasks swebench` (each task names its image by a path on the user's machine)
WRITTEN = {f"swe_images/{name}": ROOT / "examples" / "swe_images" / "instances.jsonl"
           for name in ("run", "claude_code")}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_examples_load(path: Path) -> None:
    cfg = config.load(path)
    assert cfg.agent.command and cfg.model.path.is_absolute()
    instances = WRITTEN.get(f"{path.parent.name}/{path.stem}")
    if instances is not None:
        from lgt.trainer.rollout import swebench

        assert cfg.tasks == path.parent / "tasks.jsonl"
        assert len(swebench.convert(swebench.read_instances(instances), workdir="/testbed")) == 4
        return
    assert cfg.tasks.is_file()
    assert len(config.load_tasks(cfg.tasks)) >= 100


def test_examples_that_share_a_model_build_it_the_same_way() -> None:
    """A model folder two examples name is built by one recipe: another one would make each run
    rebuild it (``factory.is_made`` compares the settings) and the examples train different models."""
    made: dict[Path, tuple] = {}
    for path in EXAMPLES:
        cfg = config.load(path)
        teacher = cfg.teacher
        for where, make in ((cfg.model.path, cfg.model.make),
                            (teacher.path if teacher else None, teacher.make if teacher else None)):
            if where is None or make is None:
                continue
            first = made.setdefault(where.resolve(), (make, path))
            assert first[0] == make, f"{path} builds {where} unlike {first[1]}"


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.stem == "run" and (p.parent / "task.sh").exists()],
                         ids=lambda p: p.parent.name)
def test_the_harness_examples_bound_a_replys_length(path: Path) -> None:
    """A coding-agent harness asks for 32k-64k output tokens, which the demo policy spends to the
    agent's timeout on a CPU (no step in 15 minutes): each harness example caps a reply (bench/examples.py
    times them to their second step)."""
    cap = config.load(path).proxy.max_output_tokens
    assert cap is not None and cap <= config.load(path).engine.max_model_len // 4


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


def test_policies_are_read_as_written_and_saved_with_the_run(tmp_path: Path) -> None:
    section = ("policies:\n  - {name: coder, served: coder}\n"
               "  - {name: planner, match: {model: 'planner*'}, served: planner}\n"
               "  - {name: side, match: [{kind: side}, {system: '(?i)title'}]}\n")
    cfg = config.load(write(tmp_path, BASE + section))
    assert [p["name"] for p in cfg.policies] == ["coder", "planner", "side"]
    assert cfg.policies[2]["match"] == [{"kind": "side"}, {"system": "(?i)title"}]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / config.RUN_FILE).write_text(json.dumps(cfg.to_json()))
    assert config.saved(tmp_path / "run").policies == cfg.policies
    assert config.load(write(tmp_path, BASE)).policies is None  # one policy, as before


def test_a_section_written_in_part_keeps_the_runs_defaults_for_the_rest(tmp_path: Path) -> None:
    """One default per key, whether its section is written or not: ``engine: {ready_timeout: 300}``
    does not turn the run's 512-token context into the model's whole context (8k-32k for a real
    model). Checked for every section whose default is an instance of its config."""
    bare = config.load(write(tmp_path, BASE))
    assert bare.engine.max_model_len == 512 and bare.backend.max_seq_len == 512
    engine = config.load(write(tmp_path, BASE + "engine: {ready_timeout: 300}\n"))
    assert engine.engine.max_model_len == 512 and engine.backend.max_seq_len == 512
    assert engine.engine.ready_timeout == 300
    whole = config.load(write(tmp_path, BASE + "engine: {max_model_len: null}\n"))
    assert whole.engine.max_model_len is None  # the model's whole context, when asked for by name
    for f in dataclasses.fields(config.RunConfig):
        default = f.default
        if not dataclasses.is_dataclass(default):
            continue
        key = next(k.name for k in dataclasses.fields(default) if k.name not in ("name", "loss", "model")
                   and isinstance(getattr(default, k.name), (bool, int, float, str))
                   and not isinstance(getattr(default, k.name), bool))
        value = getattr(default, key)
        written = config.load(write(tmp_path, BASE + f"{f.name}: {{{key}: {json.dumps(value)}}}\n"))
        assert getattr(written, f.name) == getattr(bare, f.name), f.name


def test_the_teachers_engine_is_the_runs_with_one_more_position_whatever_it_writes(tmp_path: Path) -> None:
    teacher = BASE + "algorithm: {estimator: opd}\nteacher: {path: t%s}\n"
    derived = config.load(write(tmp_path, teacher % ""))
    assert derived.teacher.engine.max_model_len == 513 and derived.teacher.engine.url is None
    written = config.load(write(tmp_path, teacher % ", engine: {ready_timeout: 300}"))
    assert (written.teacher.engine.max_model_len, written.teacher.engine.ready_timeout) == (513, 300)
    longer = config.load(write(tmp_path, teacher % ", engine: {max_model_len: 1024}"))
    assert longer.teacher.engine.max_model_len == 1024


def test_the_served_model_name_is_one_setting(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, BASE + "engine: {served_model_name: qwen-named}\n"))
    assert cfg.engine.served_model_name == "qwen-named"
    from lgt.trainer.apo.optimize import Critic, CriticConfig
    assert Critic(CriticConfig(), "http://e/v1", cfg.engine.served_model_name).model == "qwen-named"
    hosted = CriticConfig(base_url="http://c/v1", model="big")
    assert Critic(hosted, "http://e/v1", "qwen-named").model == "big"
    with pytest.raises(ValueError, match="apo.critic.model is required with apo.critic.base_url"):
        CriticConfig(base_url="http://c/v1")


def test_overrides(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, BASE), {"mode": "sync", "backend.lr": 0.01, "agent.retries": 0,
                                              "max_samples": 640})
    assert (cfg.mode, cfg.backend.lr, cfg.agent.retries, cfg.max_samples) == ("sync", 0.01, 0, 640)


@pytest.mark.parametrize("extra, message", [
    ("mode: fast\n", "mode must be one of sync, async, not 'fast'"),
    ("grup_size: 4\n", "unknown key grup_size"),
    ("backend: {lrr: 1}\n", "unknown key backend.lrr"),
    ("group_size: four\n", "group_size must be an integer, not 'four'"),
    ("backend: {lr: -1}\n", "backend.lr must be a finite number > 0, not -1"),
    ("algorithm: {is_mode: trunc}\n", "algorithm: unknown importance-sampling mode 'trunc'; choose one of: "
                                       "none, truncate, mask"),
    ("algorithm: {estimator: ppo}\n", "algorithm: unknown advantage estimator 'ppo'"),
    ("backend: {name: jax}\n", "backend.name must be one of torch, verl, not 'jax'"),
    ("proxy: {max_output_tokens: 0}\n", "proxy.max_output_tokens must be a positive number of tokens"),
    ("proxy: {on_update: keep}\n", "proxy.on_update must be drain or continue, not 'keep'"),
    ("proxy: {url: http://127.0.0.1:1, max_output_tokens: 64}\nstore: s\n",
     "proxy.max_output_tokens sets a proxy the run starts; give the running proxy --max-output-tokens"),
    ("backend: {world_size: 2}\n", "unknown key backend.world_size"),
    ("backend: {name: verl, world_size: 0}\n", "backend.world_size must be a positive integer, not 0"),
    ("backend: {loss: {agg: rollout}}\n", "backend.loss is set by the algorithm section; leave it out"),
    ("engine: {model: /x}\n", "engine.model is set by model.path"),
    ("backend: {name: verl, entropy_coeff: 0.1}\n", "backend.entropy_coeff and algorithm.kl_coef must be 0"),
    ("backend: {betas: [0.9]}\n", "backend.betas must be a list of 2 values"),
    ("max_inflight: 2\n", "max_inflight (2) must hold at least one group (8 rollouts)"),
    ("agent: {command: []}\n", "agent: the agent command must be a non-empty list of strings"),
    ("agent: {command: x, proxy_mode: socks}\n",
     "agent: agent proxy_mode must be one of https_proxy, base_url"),
    ("agent: {command: x, python_preload: [openai]}\n", "python_preload needs an agent command that runs a "
                                                         "Python script"),
    ("algorithm: {sample_mode: fuzzy}\n",
     "algorithm: unknown sample mode 'fuzzy'; choose one of: exact, realign"),
    ("engine: 3\n", "engine must be a mapping"),
    ("proxy: {url: 'localhost:1'}\n", "proxy.url must be the control API's http(s) URL"),
    ("proxy: {upstream_timeout_s: 0}\n", "proxy.upstream_timeout_s must be a positive number of seconds"),
    ("restarts: -1\n", "restarts must be a whole number ≥ 0, not -1"),
    ("max_staleness: -1\n", "max_staleness must be 0 or more, not -1"),
    ("staleness: drop\n", "staleness must be one of mask, truncate, group, not 'drop'"),
    ("algorithm: {std_normalize: 'yes'}\n", "algorithm.std_normalize must be true or false"),
    ("policies: []\n", "policies must be a list of at least one policy"),
    ("policies: [{name: a}, {name: a, match: {kind: side}}]\n", "two policies are named 'a'"),
    ("policies: [{name: a}, {name: b, match: {model_name: x}}]\n",
     "policy 'b''s rule has unknown condition(s) model_name (known: model, system, kind)"),
    ("policies: [{name: a}, {name: b, match: {system: '[x'}}]\n",
     "policy 'b''s rule: system '[x' is not a regular expression"),
    ("policies: [{name: a}, {name: b, match: {model: p}}, {name: c, match: {model: p}}]\n",
     "policy 'c' and policy 'b' have the same rule {model: 'p'}: a call cannot belong to both"),
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


def test_sections_are_the_components_configs(tmp_path: Path) -> None:
    from lgt.trainer.backends.base import TorchConfig, VerlConfig
    from lgt.trainer.rl.algorithm import AlgorithmConfig, LossConfig
    from lgt.trainer.serving.launch import EngineConfig

    cfg = config.load(write(tmp_path, BASE
                            + "algorithm: {kl_coef: 0.1, kl_kind: k2, dual_clip: 3, agg: token-mean}\n"
                              "engine: {max_model_len: 300, dtype: bfloat16}\n"
                              "backend: {betas: [0.8, 0.9]}\n"))
    assert isinstance(cfg.engine, EngineConfig) and isinstance(cfg.algorithm, AlgorithmConfig)
    assert isinstance(cfg.backend, TorchConfig) and cfg.backend.betas == (0.8, 0.9)
    # the backend's loss is the algorithm's, every loss setting reachable from YAML
    assert cfg.backend.loss == LossConfig(kl_coef=0.1, kl_kind="k2", dual_clip=3.0, agg="token-mean")
    assert cfg.backend.max_seq_len == 300  # the torch backend takes the engine's context
    verl = config.load(write(tmp_path, BASE
                             + "backend: {name: verl, world_size: 2, ray_address: auto, lr: 1e-5}\n"
                               "algorithm: {clip_high: 0.3}\n"))
    assert isinstance(verl.backend, VerlConfig)
    assert (verl.backend.world_size, verl.backend.ray_address) == (2, "auto")
    from lgt.trainer import preflight

    verl_python = tmp_path / "verl-env" / "python"  # where backend.python says verl is installed
    verl_python.parent.mkdir()
    verl_python.touch()
    moved = config.load(write(tmp_path, BASE + f"backend: {{name: verl, python: {verl_python}}}\n"))
    assert preflight.backend_python(moved) == str(verl_python)
    assert verl.backend.loss.clip_high == 0.3
    assert json.loads(json.dumps(verl.to_json()))["backend"]["name"] == "verl"


def test_validate_checks_everything_before_anything_starts(tmp_path: Path) -> None:
    from lgt.trainer import preflight

    cfg = config.load(write(tmp_path, BASE.replace("[python, agent.py]", "[no-such-agent-cmd]")))
    with pytest.raises(ValueError, match="the agent command 'no-such-agent-cmd' was not found on PATH"):
        preflight.validate(cfg)
    cfg = config.load(write(tmp_path, BASE))
    (tmp_path / "tasks.jsonl").unlink()
    with pytest.raises(config.ConfigError, match="tasks file .*tasks.jsonl does not exist"):
        preflight.validate(cfg)
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "a"}\n')
    with pytest.raises(ValueError, match=r"m does not exist: give a directory holding a Hugging Face model"):
        preflight.validate(cfg)  # no model and no model.make
    made = config.load(write(tmp_path, BASE.replace("model: {path: m}",
                                                    "model: {path: m, make: {preset: huge}}")))
    with pytest.raises(config.ConfigError, match="model.make.preset must be one of .*, not 'huge'"):
        preflight.validate(made)
    made = config.load(write(tmp_path, BASE.replace("model: {path: m}",
                                                    "model: {path: m, make: {preset: demo, steps: 0}}")))
    with pytest.raises(config.ConfigError, match="model.make.steps must be 1 or more, not 0"):
        preflight.validate(made)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml", "tasks.jsonl"]  # nothing written


def test_run_refuses_a_typo_before_building_or_starting_anything(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from lgt.trainer.cli import main

    path = write(tmp_path, BASE.replace("model: {path: m}", "model: {path: m, make: {preset: demo}}")
                 + "algorithm: {is_mode: trunc}\n")
    result = CliRunner().invoke(main, ["run", str(path), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 1
    assert "unknown importance-sampling mode 'trunc'" in result.output
    assert not (tmp_path / "m").exists() and not (tmp_path / "run").exists()  # no model built, no run dir


def test_run_refuses_a_run_dir_that_holds_a_run(tmp_path: Path) -> None:
    # a second run into the same folder would append to its metrics and mix two runs in one summary
    from click.testing import CliRunner

    from lgt.trainer.cli import main

    path = write(tmp_path, BASE.replace("model: {path: m}", "model: {path: m, make: {preset: demo}}"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    result = CliRunner().invoke(main, ["run", str(path), "--run-dir", str(run_dir)])
    assert result.exit_code == 1
    assert f"{run_dir} already holds a run (it has a config.json): continue it with --resume {run_dir}" in (
        " ".join(result.output.split()))
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "metrics.jsonl"]
    assert not (tmp_path / "m").exists()


def test_a_nameless_run_is_named_after_its_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `lgt-train run run.yaml` from the config's own folder: named after the folder, not "" (runs/-<time>)
    folder = tmp_path / "my_agent"
    folder.mkdir()
    write(folder, BASE)
    monkeypatch.chdir(folder)
    cfg = config.load(Path("run.yaml"))
    assert cfg.name == "my_agent"
    assert config.default_run_dir(cfg, tmp_path).name.startswith("my_agent-")
    (folder / "fast.yaml").write_text(BASE)
    assert config.load(Path("fast.yaml")).name == "fast"
    assert config.load(Path("./run.yaml")).name == "my_agent"
    with pytest.raises(config.ConfigError, match="name must be a name for the run's folder"):
        config.load(Path("run.yaml"), {"name": "a/b"})


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_saved_config_loads_back_as_the_same_run(path: Path, tmp_path: Path) -> None:
    cfg = config.load(path)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_json()))
    assert config.saved(tmp_path) == cfg
    assert config.saved(tmp_path, {"steps": 7, "backend.lr": 0.5}) == dataclasses.replace(
        cfg, steps=7, backend=dataclasses.replace(cfg.backend, lr=0.5))


def saved_verl_run(tmp_path: Path) -> Path:
    cfg = config.load(write(tmp_path, BASE), {"backend.name": "verl", "backend.world_size": 2})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(cfg.to_json()))
    return run_dir


def test_resume_continues_the_run_as_it_was_configured(tmp_path: Path) -> None:
    run_dir = saved_verl_run(tmp_path)
    cfg = config.saved(run_dir, {"steps": 4})
    assert (cfg.backend.name, cfg.backend.world_size, cfg.steps) == ("verl", 2, 4)
    # the config file without the run's --set differs in what the checkpoints were made with
    diff = config.differences(cfg, config.load(tmp_path / "run.yaml", {"steps": 4}))
    assert diff == ["backend"]
    assert config.differences(cfg, config.saved(run_dir, {"steps": 5, "backend.lr": 0.1})) == [
        "backend.lr", "steps"]


@pytest.mark.parametrize("override, message", [
    ({"backend.name": "torch"}, "backend.name was 'verl' when run was trained, and its checkpoints cannot be "
                                "resumed with 'torch': start a new run for that"),
    ({"backend.world_size": 4}, "backend.world_size was 2 when run was trained"),
    ({"model.path": "/elsewhere/m"}, "model.path was '"),
])
def test_resume_refuses_what_the_checkpoints_cannot_take(tmp_path: Path, override: dict,
                                                         message: str) -> None:
    run_dir = saved_verl_run(tmp_path)
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.saved(run_dir, override)


def test_a_refused_resume_leaves_the_run_directory_as_it_was(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from lgt.trainer.cli import main

    run_dir = saved_verl_run(tmp_path)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {p: p.read_bytes() for p in run_dir.rglob("*")}
    result = CliRunner().invoke(main, ["run", str(tmp_path / "run.yaml"), "--resume", str(run_dir),
                                       "--set", "backend.name=torch"])
    assert result.exit_code == 1
    assert "backend.name was 'verl' when run was trained" in " ".join(result.output.split())
    assert {p: p.read_bytes() for p in run_dir.rglob("*")} == before
    result = CliRunner().invoke(main, ["run", "--resume", str(tmp_path / "nothing")])
    assert result.exit_code == 2  # click: the folder does not exist
    result = CliRunner().invoke(main, ["run"])
    assert result.exit_code == 2 and "give a run config (CONFIG_FILE), or --resume RUN_DIR" in result.output


def test_a_resume_that_fails_in_setup_leaves_the_run_directory_as_it_was(tmp_path: Path,
                                                                          tiny_model_dir: Path) -> None:
    # the checkpoint cannot be loaded (its optimizer state is gone): one sentence, and neither
    # config.json nor the summary, plots or report are rewritten
    from click.testing import CliRunner

    from lgt.trainer.backends.base import TorchConfig
    from lgt.trainer.backends.torch_backend import OPTIMIZER_FILE, TorchBackend
    from lgt.trainer.cli import main

    path = write(tmp_path, BASE.replace("model: {path: m}", f"model: {{path: {tiny_model_dir}}}"))
    cfg = config.load(path)
    run_dir = tmp_path / "run"
    for sub in ("logs", "store"):
        (run_dir / sub).mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_json()))
    (run_dir / "summary.json").write_text('{"steps": 1}')
    ckpt = TorchBackend.load(tiny_model_dir, TorchConfig()).save_checkpoint(run_dir / "checkpoints", {})
    (ckpt / OPTIMIZER_FILE).unlink()
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    result = CliRunner().invoke(main, ["run", str(path), "--resume", str(run_dir), "--steps", "9"])
    assert result.exit_code == 1, result.output
    assert OPTIMIZER_FILE in result.output
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_a_checkpoint_is_named_by_its_folder_or_its_run(tmp_path: Path) -> None:
    from lgt.trainer.backends.checkpoints import CheckpointError, find_checkpoint

    run = tmp_path / "sft-run"
    done, unfinished = run / "checkpoints" / "step-00000003", run / "checkpoints" / "step-00000005"
    for d in (done, unfinished):
        d.mkdir(parents=True)
    (done / "DONE").write_text("3\n")
    assert find_checkpoint(run) == find_checkpoint(run / "checkpoints") == find_checkpoint(done) == done
    with pytest.raises(CheckpointError, match="step-00000005 is not a finished checkpoint"):
        find_checkpoint(unfinished)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty holds no finished checkpoint: give a run's folder"):
        find_checkpoint(tmp_path / "empty")


def test_run_from_a_checkpoint_trains_it_instead_of_the_configs_model(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from lgt.trainer.cli import main

    path = write(tmp_path, BASE.replace("model: {path: m}", "model: {path: m, make: {preset: demo}}"))
    sft = tmp_path / "sft-run"
    ckpt = sft / "checkpoints" / "step-00000011"
    ckpt.mkdir(parents=True)
    (ckpt / "DONE").write_text("11\n")
    # the checkpoint is the model the run checks (this one holds no weights), and nothing is made
    result = CliRunner().invoke(main, ["run", str(path), "--checkpoint", str(sft), "--run-dir",
                                       str(tmp_path / "run")])
    assert result.exit_code == 1 and str(ckpt) in " ".join(result.output.split()), result.output
    assert not (tmp_path / "m").exists() and not (tmp_path / "run").exists()
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(main, ["run", str(path), "--checkpoint", str(tmp_path / "empty")])
    assert result.exit_code == 1 and "holds no finished checkpoint" in result.output
    result = CliRunner().invoke(main, ["run", "--checkpoint", str(sft), "--resume", str(sft)])
    assert result.exit_code == 1 and "not both" in result.output


def test_old_checkpoints_are_pruned_to_the_newest_kept(tmp_path: Path) -> None:
    from lgt.trainer.backends.checkpoints import latest_checkpoint, prune_checkpoints

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 10):
        (root / f"step-{step:08d}").mkdir(parents=True)
        (root / f"step-{step:08d}" / "DONE").write_text(f"{step}\n")
    (root / "step-00000011").mkdir()  # unfinished: being written, or a crash's; never deleted
    assert prune_checkpoints(root, None) == [] and len(list(root.iterdir())) == 5
    assert [p.name for p in prune_checkpoints(root, 2)] == ["step-00000001", "step-00000002"]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003", "step-00000010", "step-00000011"]
    assert latest_checkpoint(root) == root / "step-00000010"  # by number, not by name order
    assert prune_checkpoints(root, 2) == []
    with pytest.raises(config.ConfigError, match="keep_checkpoints must be at least 1"):
        config.load(write(tmp_path, BASE + "keep_checkpoints: 0\n"))
    assert config.load(write(tmp_path, BASE + "keep_checkpoints: null\n")).keep_checkpoints is None
