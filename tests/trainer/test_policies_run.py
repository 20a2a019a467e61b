"""Several policies trained in one ``lgt-train run`` (docs/policies.md, "Training"): each policy a LoRA
adapter on the shared base model, trained on its own calls only, served by the one engine as
``<policy>-v<version>``, checkpointed and resumed on its own.

Fast tests: what a run refuses of a ``policies`` section, how a policy's ``backend`` keys merge with the
run's, and each policy's advantages taken within its own table. The slow one runs the two-role agent
(tests/agents/two_roles.py: a ``planner`` call, then a ``coder`` call) for 2 steps on the vLLM CPU build
and a real lgt-proxy, the planner left out of step 1's task, then resumes it for a third step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml

from lgt.trainer import config
from lgt.trainer.config import ConfigError
from lgt.trainer.rl.algorithm import AlgorithmConfig
from lgt.trainer.run import admission

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "tests" / "agents" / "two_roles.py"
TWO = [{"name": "coder", "match": {"model": "coder"}}, {"name": "planner", "match": {"model": "planner"}}]


def load(tmp_path: Path, **over) -> config.RunConfig:
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t0", "question": "What is 1+2?", "answer": 3}\n')
    raw = {"agent": {"command": ["python", "agent.py"]}, "tasks": "tasks.jsonl", "model": {"path": "m"},
           "backend": {"lr": 1e-3, "lora": {"rank": 8, "alpha": 16}}, "policies": TWO, **over}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    return config.load(tmp_path / "run.yaml")


def test_each_policy_gets_the_runs_backend_with_its_own_keys_over_it(tmp_path: Path) -> None:
    cfg = load(tmp_path, policies=[TWO[0], {**TWO[1], "backend": {"lr": 5e-3, "lora": {"rank": 4}}}])
    got = config.policy_backends(cfg)
    assert list(got) == ["coder", "planner"]
    assert got["coder"] == cfg.backend
    assert (got["planner"].lr, got["planner"].lora.rank, got["planner"].lora.alpha) == (5e-3, 4, 16)
    assert got["planner"].micro_batch_tokens == cfg.backend.micro_batch_tokens
    # the proxy's file has no backend keys (lgt-proxy refuses keys it does not know)
    assert all("backend" not in p for p in config.proxy_section(cfg.policies))


@pytest.mark.parametrize(("over", "says"), [
    ({"backend": {"lr": 1e-3}},
     "2 policies on the run's engine need backend.lora: each trains a LoRA adapter"),
    ({"policies": [TWO[0], {**TWO[1], "upstream": "http://127.0.0.1:9/v1"}]},
     "policies[1] (planner) has an upstream of its own, whose weights lgt-train run cannot update: give it "
     "a model (policies[1].model: {path: ...})"),
    ({"policies": [{**TWO[0], "model": {"path": "m2"}}, TWO[1]]},
     "policies[0].model: the first policy is the run's own model"),
    ({"policies": [TWO[0], {**TWO[1], "engine": {"max_model_len": 64}}]},
     "policies[1].engine is for a policy on an engine of its own: give it a model too"),
    ({"policies": [TWO[0], {**TWO[1], "model": {"path": "m2"}, "engine": {"url": "http://127.0.0.1:9"}}]},
     "policies[1].engine.url: lgt-train run starts a policy's own engine"),
    ({"policies": [TWO[0], {**TWO[1], "model": {"path": "m2"}, "backend": {"lora": {"rank": 4}}}]},
     "policies[1].backend.lora: a policy on an engine of its own trains its full weights"),
    ({"policies": [TWO[0], {**TWO[1], "model": {"path": "m2", "pth": 1}}]},
     "unknown key policies[1].model.pth"),
    ({"policies": [{**TWO[0], "served": "coder"}, TWO[1]]}, "policies[0].served is set by lgt-train run"),
    ({"policies": [TWO[0], {**TWO[1], "backend": {"lrr": 1}}]}, "unknown key policies[1].backend.lrr"),
    ({"policies": [TWO[0], {**TWO[1], "backend": {"name": "verl"}}]},
     "policies[1].backend.name: every policy trains on the run's backend"),
    ({"policies": [TWO[0], {**TWO[1], "backend": {"lora": {"rank": 64}}}], "engine": {"max_lora_rank": 16}},
     "policy 'planner': backend.lora.rank 64 is above the engine's max_lora_rank"),
    ({"engine": {"serve_adapters": False}},
     "several policies on the run's engine need it to serve their adapters"),
    ({"policies": [{**TWO[0], "backend": {"lr": 1}}]}, "policies[0].backend is for a run of several"),
])
def test_what_a_run_cannot_train_is_one_sentence(tmp_path: Path, over: dict, says: str) -> None:
    cfg = load(tmp_path, **over)  # the config itself loads: eval and the proxy read the section
    with pytest.raises(ConfigError) as e:
        config.policy_backends(cfg)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_policy_on_its_own_engine_trains_every_weight_and_the_proxy_gets_its_route(tmp_path: Path) -> None:
    planner = {**TWO[1], "model": {"path": "planner-model"}, "engine": {"max_model_len": 512},
               "backend": {"lr": 5e-3}}
    cfg = load(tmp_path, policies=[TWO[0], planner], engine={"max_model_len": 256, "max_num_seqs": 4})
    own = config.own_engines(cfg)
    assert list(own) == ["planner"] and own["planner"].model.path == tmp_path / "planner-model"
    # the run's engine section with the policy's own keys over it
    assert (own["planner"].engine.max_model_len, own["planner"].engine.max_num_seqs) == (512, 4)
    got = config.policy_backends(cfg)
    # the run's LoRA is the shared engine's policies'; the planner trains its full weights
    assert got["coder"] == cfg.backend and got["coder"].lora is not None
    assert got["planner"].lora is None and got["planner"].lr == 5e-3
    # the proxy's section names neither the model nor the engine (lgt-train run adds its route)
    assert config.proxy_section(cfg.policies)[1] == TWO[1]
    # one policy on the run's engine trains as a run of one policy: LoRA is not required then
    cfg = load(tmp_path, backend={"lr": 1e-3}, policies=[TWO[0], planner])
    assert config.policy_backends(cfg)["coder"].lora is None


def test_one_policy_without_lora_trains_as_a_run_without_the_section(tmp_path: Path) -> None:
    cfg = load(tmp_path, backend={"lr": 1e-3}, policies=[{"name": "agent"}])
    assert not config.several_policies(cfg) and config.policy_backends(cfg) == {"agent": cfg.backend}


def _samples(rows: list[tuple[str, str, str, float]]) -> pa.Table:
    from lgt.store.samples import SAMPLES

    out = []
    for i, (policy, rollout, group, reward) in enumerate(rows):
        out.append({"sample_id": f"s{i}", "rollout_id": rollout, "attempt": 0, "group_id": group,
                    "task_id": "t", "sample_index": 0, "n_calls": 1, "input_ids": [1, 2, 3],
                    "loss_mask": [0, 1, 1], "behaviour_logprobs": [None, -1.0, -1.0],
                    "policy_versions": [None, 0, 0], "reward": reward, "rollout_tokens": 2,
                    "mode": "exact", "policy": policy})
    return pa.Table.from_pylist(out, schema=SAMPLES)


def test_each_policys_advantages_are_taken_within_its_own_table() -> None:
    # group g: rollouts a (reward 1) and b (0) call the coder; only a calls the planner
    t = _samples([("coder", "a", "g", 1.0), ("coder", "b", "g", 0.0), ("planner", "a", "g", 1.0)])
    whole, each = admission.prepare_policies(t, ["coder", "planner", "judge"], 0, AlgorithmConfig(), 1)
    coder = dict(zip(each["coder"].samples["rollout_id"].to_pylist(),
                     each["coder"].samples["advantage"].to_pylist()))
    assert coder["a"] > 0 > coder["b"]
    # the planner's group has one rollout: no baseline to beat, no advantage (the coder's b is not in it)
    assert each["planner"].samples["advantage"].to_pylist() == [0.0]
    assert each["judge"].samples.num_rows == 0 and each["judge"].rollouts == 0
    assert sorted(whole.samples["sample_id"].to_pylist()) == ["s0", "s1", "s2"] and whole.rollouts == 2


# ---------------------------------------------------------------- slow: a real run, then its resume

def _lora_b(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    from lgt.trainer.policy import adapter_folder

    adapter = adapter_folder(folder)
    assert adapter is not None, f"{folder} holds no adapter"
    return {k: v for k, v in load_file(str(adapter / "adapter_model.safetensors")).items() if "lora_B" in k}


@pytest.mark.slow
def test_two_policies_train_on_their_own_calls_and_resume(tmp_path: Path, arith_model_dir: Path) -> None:
    from lgt.store.query import connect
    from lgt.testing.runs import lgt_train, lgt_train_cmd, metrics, write_config
    from lgt.trainer.backends.checkpoints import finished_checkpoints

    # step 1 runs the task whose rollouts make no planner call (the run's seeded task order says which)
    first = admission.task_index(0, 2, 0)
    tasks = [{"task_id": "both", "question": "What is 2+3?", "answer": 5, "roles": "planner,coder"}]
    tasks.insert(first, {"task_id": "coder-only", "question": "What is 4+1?", "answer": 5, "roles": "coder"})
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    cfg = write_config(tmp_path, arith_model_dir, steps=2, mode="sync", group_size=4, batch_groups=1,
                       tasks=str(tmp_path / "tasks.jsonl"), seed=0,
                       agent={"command": [sys.executable, str(AGENT)], "python_preload": ["openai"],
                              "env": {"OPENAI_BASE_URL": "https://api.openai.invalid/v1"}, "timeout_s": 90},
                       backend={"lr": 1e-2, "lora": {"rank": 8}},
                       policies=[TWO[0], {**TWO[1], "backend": {"lr": 2e-2}}])
    run_dir = tmp_path / "run"
    out = lgt_train(str(cfg), "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    text = " ".join((out.stdout + out.stderr).split())
    assert "LoRA: 2 policies (coder, planner), each update loads each policy's adapter" in text

    rows = metrics(run_dir)
    assert [r["version"] for r in rows] == [1, 2]
    # each policy trained on its own calls: one sample per call of its role, none of the other's
    assert (rows[0]["policy/coder/samples"], rows[0]["policy/planner/samples"]) == (4, 0)
    assert (rows[1]["policy/coder/samples"], rows[1]["policy/planner/samples"]) == (4, 4)
    assert "policy/coder/loss" in rows[0] and "policy/planner/loss" not in rows[0]

    con = connect(run_dir / "store")
    calls = con.execute("SELECT requested_model, policy, served_model, policy_version FROM calls").fetchall()
    assert len(calls) == 4 + 8
    for requested, policy, served, version in calls:  # its role's policy, its adapter at its version
        assert policy == requested and served == f"{policy}-v{version}", (requested, policy, served, version)
    assert {v for *_, v in calls} == {0, 1}

    # checkpoints per policy; the planner, with no call in step 1, did not move; the coder did
    ckpts = run_dir / "checkpoints" / "policies"
    assert not list((run_dir / "checkpoints").glob("step-*"))
    step1 = {name: _lora_b(ckpts / name / "step-00000001") for name in ("coder", "planner")}
    step2 = {name: _lora_b(ckpts / name / "step-00000002") for name in ("coder", "planner")}
    assert step1["planner"] and all(float(t.abs().max()) == 0.0 for t in step1["planner"].values())
    assert max(float(t.abs().max()) for t in step1["coder"].values()) > 0
    assert max(float(t.abs().max()) for t in step2["planner"].values()) > 0

    # resumed for one more step: each policy from its own checkpoint, its calls to <policy>-v2
    out = lgt_train(str(cfg), "--resume", str(run_dir), "--steps", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    text = " ".join((out.stdout + out.stderr).split())
    assert "resuming 2 policies from step-00000002: step 2, policy version 2" in text
    assert [r["version"] for r in metrics(run_dir)] == [1, 2, 3]
    con = connect(run_dir / "store")
    late = con.execute("SELECT DISTINCT policy, served_model FROM calls WHERE policy_version = 2").fetchall()
    roles = tasks[admission.task_index(0, 2, 2)]["roles"].split(",")  # step 3's task
    assert sorted(late) == sorted((r, f"{r}-v2") for r in roles)
    for name in ("coder", "planner"):
        assert [p.name for p in finished_checkpoints(ckpts / name)][-1] == "step-00000003"

    # lgt-train export: one policy at a time, named
    out = lgt_train_cmd("export", str(run_dir), "--merge", str(tmp_path / "m"))
    assert out.returncode != 0 and "trained several policies (coder, planner): name the one to export " \
        "with --policy" in out.stderr
    out = lgt_train_cmd("export", str(run_dir), "--policy", "planner", "--step", "2", "--merge",
                        str(tmp_path / "planner"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "planner" / "config.json").is_file()

    # lgt-train eval of the run: each policy's adapter of the newest step, each call to its own
    held = {"task_id": "held", "question": "What is 3+3?", "answer": 6, "roles": "planner,coder"}
    (tmp_path / "held.jsonl").write_text(json.dumps(held) + "\n")
    out = lgt_train_cmd("eval", str(cfg), "--checkpoint", str(run_dir), "--run-dir", str(tmp_path / "ev"),
                        "--set", f"eval={{tasks: {tmp_path / 'held.jsonl'}, samples: 0}}")
    assert out.returncode == 0, out.stderr[-3000:]
    con = connect(tmp_path / "ev" / "store")
    got = con.execute("SELECT DISTINCT policy, served_model, policy_version FROM calls").fetchall()
    assert sorted(got) == [("coder", "coder-v3", 3), ("planner", "planner-v3", 3)]


def test_the_two_roles_example_trains_two_policies() -> None:
    cfg = config.load(ROOT / "examples" / "two_roles" / "run.yaml")
    backends = config.policy_backends(cfg)
    assert list(backends) == ["coder", "planner"]
    assert (backends["coder"].lr, backends["planner"].lr, backends["planner"].lora.rank) == (1e-3, 5e-4, 8)


def _recorded_vs(model_dir: Path, calls: list[tuple[list[int], list[int], list[float]]]) -> float:
    """The largest gap between the recorded logprobs of ``calls`` (prompt ids, response ids, logprobs) and
    what transformers computes for the same tokens with the model in ``model_dir``."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    gap = 0.0
    with torch.no_grad():
        for prompt, response, recorded in calls:
            ids = [*prompt, *response]
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            gap = max(gap, float(np.abs(lp.numpy()[len(prompt) - 1:] - np.asarray(recorded)).max()))
    return gap


@pytest.mark.slow
def test_a_policy_on_its_own_engine_is_served_and_trained_there(tmp_path: Path,
                                                                arith_model_dir: Path) -> None:
    from lgt.store.query import connect
    from lgt.testing.runs import lgt_train, lgt_train_cmd, metrics, write_config

    tasks = [{"task_id": "a", "question": "What is 2+3?", "answer": 5, "roles": "planner,coder"},
             {"task_id": "b", "question": "What is 4+1?", "answer": 5, "roles": "planner,coder"}]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    # the coder: every weight of the run's model on the run's engine; the planner: a model of its own (the
    # same demo model here) on an engine of its own, every weight trained
    planner = {**TWO[1], "model": {"path": str(arith_model_dir)}, "backend": {"lr": 5e-2}}
    cfg = write_config(tmp_path, arith_model_dir, steps=2, mode="sync", group_size=4, batch_groups=1,
                       tasks=str(tmp_path / "tasks.jsonl"), seed=0,
                       agent={"command": [sys.executable, str(AGENT)], "python_preload": ["openai"],
                              "env": {"OPENAI_BASE_URL": "https://api.openai.invalid/v1"}, "timeout_s": 90},
                       backend={"lr": 1e-2}, policies=[TWO[0], planner])
    run_dir = tmp_path / "run"
    out = lgt_train(str(cfg), "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    text = " ".join((out.stdout + out.stderr).split())
    assert "starting policy planner's own vLLM engine on" in text
    assert (run_dir / "logs" / "engine-planner.log").is_file()

    rows = metrics(run_dir)
    assert [r["version"] for r in rows] == [1, 2]
    assert all((r["policy/coder/samples"], r["policy/planner/samples"]) == (4, 4) for r in rows)
    assert all(r["perf/sync_policies_s"] > 0 for r in rows)

    con = connect(run_dir / "store")
    calls = con.execute("SELECT policy, served_model, policy_version, prompt_token_ids, response_token_ids, "
                        "response_logprobs FROM calls").fetchall()
    assert len(calls) == 16
    # the planner's calls went to its engine (its name), the coder's to the run's (the engine's name)
    assert {(p, s) for p, s, *_ in calls} == {("planner", "planner"), ("coder", "policy")}

    # the planner's version-1 calls were answered by the weights its step 1 trained, on its own engine
    ckpt = run_dir / "checkpoints" / "policies" / "planner" / "step-00000001"
    late = [(list(pr), list(r), list(lp)) for p, _, v, pr, r, lp in calls if p == "planner" and v == 1]
    assert late
    assert _recorded_vs(ckpt, late) < 2e-3
    assert _recorded_vs(arith_model_dir, late) > 2e-2  # not the weights it started on

    # lgt-train eval of the run: the planner's engine on its step-2 checkpoint, the coder's on its own
    held = {"task_id": "held", "question": "What is 3+3?", "answer": 6, "roles": "planner,coder"}
    (tmp_path / "held.jsonl").write_text(json.dumps(held) + "\n")
    out = lgt_train_cmd("eval", str(cfg), "--checkpoint", str(run_dir), "--run-dir", str(tmp_path / "ev"),
                        "--set", f"eval={{tasks: {tmp_path / 'held.jsonl'}, samples: 0}}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "starting policy planner's own vLLM engine on step-00000002" in " ".join(out.stderr.split())
    con = connect(tmp_path / "ev" / "store")
    got = con.execute("SELECT DISTINCT policy, served_model, policy_version FROM calls").fetchall()
    assert sorted(got) == [("coder", "policy", 2), ("planner", "planner", 2)]
