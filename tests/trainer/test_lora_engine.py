"""LoRA adapters into the running engine (trainer/serving/engine.py's load_adapter, launch.py's flags,
sync.py's Adapters) and the proxy routing each version's calls to its adapter (supervisor.py's push,
the control API's resume with served_model).

Fast tests cover the command line, the rank refusals and the choice of sync. The slow ones share one
vLLM CPU engine started for adapters on the tiny model: an adapter made with peft (its lora_B perturbed,
so it is not the base) is served with transformers' logprobs; a second version replaces it and the
first is unloaded; a run's supervisor attached to the engine, with a real lgt-proxy, sends the calls
after each resume to the new adapter and records the right policy_version.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lgt.store.query import connect
from lgt.trainer.run.progress import Progress
from lgt.trainer.run.supervisor import Supervisor
from lgt.trainer.serving.engine import Engine
from lgt.trainer.serving.launch import EngineConfig, EngineError, build_command, build_env, lora_max_rank
from lgt.trainer.serving.proxy import ProxySection
from lgt.trainer.serving.sync import Adapters, FullWeights, choose

PROMPT_IDS = [1, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150]
TOLERANCE = 1e-4  # as test_engine.py's weight sync against transformers
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---------------------------------------------------------------- fast: flags, refusals, the choice


def test_an_engine_for_adapters_gets_the_lora_flags_and_the_runtime_variable(tmp_path: Path) -> None:
    plain = EngineConfig(model=tmp_path)
    assert "--enable-lora" not in build_command(plain, 8000, cpu=True, python="py")
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in build_env(plain, cpu=True, base={})
    cfg = EngineConfig(model=tmp_path, lora_rank=12)
    cmd = build_command(cfg, 8000, cpu=True, python="py")
    assert "--enable-lora" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16"  # the smallest of vLLM's ranks that holds 12
    assert cmd[cmd.index("--max-loras") + 1] == "2"
    assert build_env(cfg, cpu=True, base={})["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    fixed = build_command(EngineConfig(model=tmp_path, lora_rank=8, max_lora_rank=64, max_loras=3), 1,
                          cpu=False, python="py")
    assert fixed[fixed.index("--max-lora-rank") + 1] == "64" and fixed[fixed.index("--max-loras") + 1] == "3"


def test_a_rank_above_the_engines_max_is_one_sentence() -> None:
    assert lora_max_rank(8) == 8 and lora_max_rank(9) == 16 and lora_max_rank(16, 32) == 32
    with pytest.raises(ValueError, match=r"^backend.lora.rank 32 is above the engine's max_lora_rank 16 "
                                         r"\(vLLM's --max-lora-rank\): lower the rank or raise "
                                         r"engine.max_lora_rank$"):
        EngineConfig(lora_rank=32, max_lora_rank=16)
    with pytest.raises(ValueError, match="above the largest rank vLLM serves"):
        lora_max_rank(1024)
    with pytest.raises(ValueError, match="engine max_lora_rank must be one of vLLM's"):
        EngineConfig(max_lora_rank=12)
    with pytest.raises(ValueError, match="a LoRA rank is a positive whole number"):
        lora_max_rank(0)


def test_the_run_config_refuses_a_rank_above_engine_max_lora_rank(tmp_path: Path) -> None:
    """The torch backend's backend.lora: the check reads its rank."""
    import dataclasses

    from lgt.trainer import config
    from lgt.trainer.backends.base import LoraConfig, TorchConfig

    (tmp_path / "tasks.jsonl").write_text('{"task_id": "a", "question": "q"}\n')
    (tmp_path / "run.yaml").write_text("agent: {command: [python, agent.py]}\ntasks: tasks.jsonl\n"
                                       "model: {path: m}\nengine: {max_lora_rank: 16}\n")
    cfg = config.load(tmp_path / "run.yaml")
    assert cfg.engine.max_lora_rank == 16
    config.validate(dataclasses.replace(cfg, backend=TorchConfig(lora=None)))  # full fine-tuning
    with pytest.raises(config.ConfigError, match=r"^backend.lora.rank 32 is above the engine's max_lora_rank "
                                                 r"16 \(vLLM's --max-lora-rank\)"):
        config.validate(dataclasses.replace(cfg, backend=TorchConfig(lora=LoraConfig(rank=32))))
    # an engine that serves no adapters takes the merged weights whatever the rank
    config.validate(dataclasses.replace(cfg, backend=TorchConfig(lora=LoraConfig(rank=32)),
                                        engine=dataclasses.replace(cfg.engine, serve_adapters=False)))
    with pytest.raises(config.ConfigError,
                       match=r"^engine.lora_rank is set by backend.lora.rank; leave it out$"):
        config.load(_written(tmp_path, "engine: {lora_rank: 8}\n"))


def _written(tmp_path: Path, extra: str) -> Path:
    p = tmp_path / "run2.yaml"
    p.write_text("agent: {command: [python, agent.py]}\ntasks: tasks.jsonl\nmodel: {path: m}\n" + extra)
    return p


def test_an_engine_not_started_for_adapters_refuses_one_before_any_request(tmp_path: Path) -> None:
    eng = Engine(EngineConfig(model=tmp_path), None, 1, None, cpu=True, weight_shapes={}, tied=False,
                 base_url="http://127.0.0.1:1")
    try:
        with pytest.raises(EngineError, match="was not started for LoRA adapters"):
            eng.load_adapter("policy-v1", tmp_path)
        eng.cfg = EngineConfig(model=tmp_path, lora_rank=8)
        with pytest.raises(EngineError, match=r"is not a PEFT adapter folder: it has no adapter_config.json "
                                              r"or adapter_model.safetensors$"):
            eng.load_adapter("policy-v1", tmp_path)
    finally:
        eng.stop()


class _Backend:
    def named_weights(self) -> list:
        return []


class _LoraBackend(_Backend):
    def save_adapter(self, path: Path) -> None:
        pass


def test_the_sync_is_the_adapter_where_backend_and_engine_can_and_one_line_says_otherwise(
        tmp_path: Path) -> None:
    lines: list[str] = []
    lora = {"rank": 8}
    assert isinstance(choose(_LoraBackend(), EngineConfig(lora_rank=8), tmp_path, say=lines.append),
                      FullWeights)  # full fine-tuning: no line
    assert lines == []
    assert isinstance(choose(_Backend(), EngineConfig(), tmp_path, lora=lora, say=lines.append), FullWeights)
    assert isinstance(choose(_LoraBackend(), EngineConfig(), tmp_path, lora=lora, say=lines.append),
                      FullWeights)
    assert isinstance(choose(_LoraBackend(), EngineConfig(serve_adapters=False), tmp_path, lora=lora,
                             say=lines.append), FullWeights)
    sync = choose(_LoraBackend(), EngineConfig(lora_rank=8, served_model_name="p"), tmp_path, lora=lora,
                  say=lines.append)
    assert isinstance(sync, Adapters) and sync.name(3) == "p-v3"
    assert lines == [
        "LoRA: the _Backend backend writes no adapter for the engine: each update sends the merged weights "
        "(the full weight path)",
        "LoRA: the engine was not started for adapters: each update sends the merged weights (the full "
        "weight path)",
        "LoRA: the engine was not started for adapters (engine.serve_adapters: false): each update sends "
        "the merged weights (the full weight path)",
        "LoRA: each update loads the new adapter into the engine as p-v<version>"]


# ---------------------------------------------------------------- slow: one vLLM engine for adapters


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    eng = Engine.start(EngineConfig(model=tiny_model_dir, max_model_len=512, lora_rank=8,
                                    log_path=tmp_path_factory.mktemp("lora-engine") / "engine.log"))
    yield eng
    eng.stop()


class PeftPolicy:
    """The tiny model with a LoRA adapter, trained by hand: ``step()`` moves every lora_B (so the
    adapter is not the base model); ``save_adapter`` is the torch backend's contract."""

    def __init__(self, model_dir: Path, rank: int = 8) -> None:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        self.gen = torch.Generator().manual_seed(rank)

    def step(self) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn(p.shape, generator=self.gen) * 0.3)

    def save_adapter(self, path: Path) -> None:
        self.model.save_pretrained(path)

    def logprobs(self, ids: list[int], adapter: bool = True) -> torch.Tensor:
        with torch.no_grad():
            if adapter:
                logits = self.model(torch.tensor([ids])).logits[0]
            else:
                with self.model.disable_adapter():
                    logits = self.model(torch.tensor([ids])).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def engine_logprobs(eng: Engine, model: str, ids: list[int]) -> torch.Tensor:
    with httpx.Client(trust_env=False, timeout=120) as http:
        resp = http.post(f"{eng.url}/completions", json={"model": model, "prompt": ids, "max_tokens": 1,
                                                         "temperature": 0, "prompt_logprobs": 0})
    resp.raise_for_status()
    steps = resp.json()["choices"][0]["prompt_logprobs"]
    return torch.tensor([step[str(tok)]["logprob"] for step, tok in zip(steps[1:], ids[1:])])


@pytest.mark.slow
def test_each_version_is_served_as_transformers_computes_it_and_the_older_unloaded(
        engine: Engine, tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = PeftPolicy(tiny_model_dir)
    sync = Adapters(policy.save_adapter, tmp_path / "adapters", "policy")
    policy.step()
    assert sync.update(engine, 1) == "policy-v1"
    v1 = policy.logprobs(PROMPT_IDS)
    assert (v1 - policy.logprobs(PROMPT_IDS, adapter=False)).abs().max() > 0.1  # not the base model
    assert (engine_logprobs(engine, "policy-v1", PROMPT_IDS) - v1).abs().max() < TOLERANCE
    base = engine_logprobs(engine, "policy", PROMPT_IDS)  # served beside it, untouched
    assert (base - policy.logprobs(PROMPT_IDS, adapter=False)).abs().max() < TOLERANCE

    policy.step()
    assert sync.update(engine, 2, drained=False) == "policy-v2"  # calls may still run on v1: kept
    assert sorted(engine.adapters()) == ["policy-v1", "policy-v2"]
    v2 = policy.logprobs(PROMPT_IDS)
    assert (v2 - v1).abs().max() > 0.1
    assert (engine_logprobs(engine, "policy-v2", PROMPT_IDS) - v2).abs().max() < TOLERANCE
    assert (engine_logprobs(engine, "policy-v1", PROMPT_IDS) - v1).abs().max() < TOLERANCE

    policy.step()
    assert sync.update(engine, 3) == "policy-v3"  # the pause drained: every other one goes
    assert engine.adapters() == ["policy-v3"]
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["v3"]  # their folders too
    assert (engine_logprobs(engine, "policy-v3", PROMPT_IDS) - policy.logprobs(PROMPT_IDS)).abs().max() \
        < TOLERANCE
    with httpx.Client(trust_env=False, timeout=60) as http:
        gone = http.post(f"{engine.url}/completions", json={"model": "policy-v1", "prompt": "hi",
                                                           "max_tokens": 1})
    assert gone.status_code == 404
    with pytest.raises(EngineError, match=r"unloading the LoRA adapter 'policy-v1' failed: the vLLM engine "
                                          r"answered 404: The lora adapter 'policy-v1' cannot be found"):
        engine.unload_adapter("policy-v1")
    sync.unload_others(engine)
    engine.unload_adapter("policy-v3")
    sync.close()


@pytest.mark.slow
def test_an_adapter_above_the_engines_rank_is_refused_by_name(engine: Engine, tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    PeftPolicy(tiny_model_dir, rank=32).save_adapter(tmp_path / "r32")
    with pytest.raises(EngineError, match=r"^the LoRA adapter in .*r32 has rank 32, above the engine's "
                                          r"--max-lora-rank 8: start the engine with engine.max_lora_rank of "
                                          r"at least 32$"):
        engine.load_adapter("big", tmp_path / "r32")  # refused before vLLM is asked
    # an engine lgt did not start (engine.url): its maximum is vLLM's to check, and its refusal is named
    attached = Engine.attach(EngineConfig(url=engine.url, model=tiny_model_dir, lora_rank=8))
    try:
        with pytest.raises(EngineError, match=r"^loading the LoRA adapter 'big' from .*r32 failed: its rank "
                                              r"32 is above the engine's --max-lora-rank 8$"):
            attached.load_adapter("big", tmp_path / "r32")
    finally:
        attached.stop()
    assert "big" not in engine.adapters()
    engine.check_alive()


def chat(base_url: str) -> None:
    with httpx.Client(trust_env=False, timeout=120) as http:
        resp = http.post(f"{base_url}/chat/completions", json={
            "model": "any-name", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert resp.status_code == 200, resp.text


@pytest.mark.slow
def test_the_proxy_sends_each_versions_calls_to_its_adapter(engine: Engine, tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    """A run's supervisor on the running engine (engine.url) with the adapter sync: it starts lgt-proxy
    naming the version's adapter; after each push and resume the calls go to the new adapter, recorded
    at the new policy_version, and the adapter before it is unloaded."""
    policy = PeftPolicy(tiny_model_dir)
    progress = Progress()
    lines: list[str] = []
    cfg = EngineConfig(url=engine.url, lora_rank=8, max_model_len=512)
    sup = Supervisor(cfg, ProxySection(), store=tmp_path / "store", store_url=tmp_path / "store",
                     logs_dir=tmp_path / "logs", seed=0, restarts=0, progress=progress, log=lines.append)
    sync = Adapters(policy.save_adapter, tmp_path / "adapters", "policy")
    try:
        sup.serve(tiny_model_dir, sync=sync)
        assert sup.served_model == "policy-v0" and engine.adapters() == ["policy-v0"]
        base_url = sup.proxy.replicas[0].rollout_env("r-lora", proxy_mode="base_url")["LGT_PROXY_BASE_URL"]
        chat(base_url)
        for version in (1, 2):
            pause = sup.proxy.pause(10)
            policy.step()
            served = sup.push(version, drained=pause["drained"])
            progress.trained([f"g{version}"], 1)
            sup.proxy.resume(progress.version, sup.served_model)
            assert served == f"policy-v{version}" and engine.adapters() == [served]
            chat(base_url)
        sup.proxy.flush()
        rows = connect(tmp_path / "store").execute(
            "SELECT policy_version, served_model FROM calls WHERE rollout_id = 'r-lora' "
            "ORDER BY started_at").fetchall()
        assert rows == [(0, "policy-v0"), (1, "policy-v1"), (2, "policy-v2")]
        assert (engine_logprobs(engine, "policy-v2", PROMPT_IDS) - policy.logprobs(PROMPT_IDS)).abs().max() \
            < TOLERANCE
    finally:
        sup.stop()
    assert not (tmp_path / "adapters").exists()
    assert engine.adapters() == []  # not the run's engine: its adapters are unloaded when the run ends


@pytest.mark.slow
def test_eval_serves_a_lora_checkpoints_adapter_on_its_base_model(engine: Engine, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    """``lgt-train eval``'s serving (Policy.serve_checkpoint) of a LoRA run's checkpoint — a finished
    checkpoint holding a PEFT adapter and naming its base model — on the running engine: the adapter
    loaded as policy-v<version>, every call through the proxy going to it at that version."""
    import json

    from lgt.trainer import config
    from lgt.trainer.backends.checkpoints import DONE, STATE_FILE
    from lgt.trainer.policy import Policy, adapter_folder

    policy = PeftPolicy(tiny_model_dir)
    policy.step()
    ckpt = tmp_path / "checkpoints" / "step-3"
    policy.save_adapter(ckpt / "adapter")
    (ckpt / STATE_FILE).write_text(json.dumps({"step": 3, "base_model": str(tiny_model_dir),
                                               "extra": {"step": 3, "version": 3}}))
    (ckpt / DONE).write_text("")
    assert adapter_folder(ckpt) == ckpt / "adapter" and adapter_folder(tiny_model_dir) is None
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "a", "question": "q"}\n')
    (tmp_path / "run.yaml").write_text(
        f"agent: {{command: [python, agent.py]}}\ntasks: tasks.jsonl\nmodel: {{path: {tmp_path / 'none'}}}\n"
        f"engine: {{url: '{engine.url}', max_model_len: 512}}\n")
    cfg = config.load(tmp_path / "run.yaml")
    served = Policy(cfg, ([], []), tmp_path / "eval")
    try:
        served.serve_checkpoint(ckpt)
        assert served.supervisor.served_model == "policy-v3" and engine.adapters() == ["policy-v3"]
        chat(served.supervisor.proxy.replicas[0].rollout_env("r-eval", proxy_mode="base_url")
             ["LGT_PROXY_BASE_URL"])
        served.supervisor.proxy.flush()
        rows = connect(served.store).execute("SELECT policy_version, served_model FROM calls").fetchall()
        assert rows == [(3, "policy-v3")]
        assert (engine_logprobs(engine, "policy-v3", PROMPT_IDS) - policy.logprobs(PROMPT_IDS)).abs().max() \
            < TOLERANCE
    finally:
        served.stop()
    assert engine.adapters() == []


@pytest.mark.slow
def test_a_lora_run_loads_each_version_and_routes_its_calls_to_it(tmp_path: Path,
                                                                  arith_model_dir: Path) -> None:
    """``lgt-train run`` with backend.lora (its own engine, started for adapters): every call recorded at
    version v went to policy-v<v>; the run's log says the adapter path; ``lgt-train eval`` of the last
    checkpoint serves its adapter, answering the run's last evaluation's greedy calls token for token."""
    import json

    from lgt.testing.runs import lgt_train, lgt_train_cmd, metrics, write_config

    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path, arith_model_dir, steps=3, eval={"split": 0.05, "every": 3, "samples": 1},
                       backend={"lr": 1e-2, "lora": {"rank": 8}})
    out = lgt_train(str(cfg), "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["version"] for r in metrics(run_dir)] == [1, 2, 3]
    text = " ".join((out.stdout + out.stderr).split())
    assert "LoRA: each update loads the new adapter into the engine as policy-v<version>" in text
    con = connect(run_dir / "store")
    pairs = con.execute("SELECT DISTINCT policy_version, served_model FROM calls ORDER BY 1").fetchall()
    assert pairs and all(model == f"policy-v{v}" for v, model in pairs)
    assert len(pairs) >= 2  # later calls went to later adapters
    answers = ("SELECT o.task_id, c.response_token_ids, c.served_model "
               "FROM calls c JOIN rollouts o USING (rollout_id, attempt) "
               "WHERE c.sampling = 'greedy' AND o.step = 3 ORDER BY 1")
    last = con.execute(answers).fetchall()
    assert last and {m for _, _, m in last} == {"policy-v3"}
    eval_dir = tmp_path / "eval"
    out = lgt_train_cmd("eval", str(cfg), "--checkpoint", str(run_dir / "checkpoints" / "step-00000003"),
                        "--run-dir", str(eval_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    [row] = [json.loads(line) for line in (eval_dir / "eval.jsonl").read_text().splitlines()]
    assert (row["step"], row["version"]) == (3, 3)
    assert connect(eval_dir / "store").execute(answers).fetchall() == last
