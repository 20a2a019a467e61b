"""LoRA on the torch backend (``backend.lora``) on the tiny random Qwen2: only the adapter trains and only
it is in AdamW; the merged weights are the policy; a checkpoint is PEFT's adapter folder and resumes
exactly; ``lgt-train export --merge`` writes a full model with the same log-probs; bad input is one
sentence before anything is loaded or written."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from test_torch_backend import make_samples, random_specs, vocab

from lgt.trainer import config as cfgmod
from lgt.trainer.backends.base import BackendError, LoraConfig, TorchConfig
from lgt.trainer.backends.checkpoints import CheckpointError, finished_checkpoints, prune_checkpoints
from lgt.trainer.backends.torch_backend import TorchBackend
from lgt.trainer.cli import main

TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith" / "run.yaml"


def lora_cfg(*, micro_batch_tokens: int = 64, **kw) -> TorchConfig:
    return TorchConfig(lr=1e-2, micro_batch_tokens=micro_batch_tokens, lora=LoraConfig(**{"rank": 4, **kw}))


def params(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.model.named_parameters()}


def run_with_checkpoint(model_dir: Path, root: Path, cfg: TorchConfig, steps: int = 2) -> TorchBackend:
    """A backend trained ``steps`` updates, checkpointed after each in ``root/checkpoints`` (a run's
    layout: a config.json beside them)."""
    backend = TorchBackend.load(model_dir, cfg)
    for k in range(steps):
        backend.train_step(make_samples(random_specs(10 + k, 4, vocab(model_dir))))
        backend.save_checkpoint(root / "checkpoints", {"step": k + 1})
    (root / "config.json").write_text("{}")
    return backend


def test_only_the_adapter_moves_and_only_it_is_in_the_optimizer(tiny_model_dir: Path) -> None:
    backend = TorchBackend.load(tiny_model_dir, lora_cfg())
    assert backend.lora == LoraConfig(rank=4)
    assert "LoRA adapter of rank 4 on " + ", ".join(TARGETS) in backend.summary
    before = params(backend)
    adapter = {n for n in before if ".lora_" in n}
    # rank 4 A (4 x in) and B (out x 4) on 7 projections of each of the 2 layers
    assert len(adapter) == 2 * 7 * 2
    in_optimizer = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in backend.model.named_parameters() if n in adapter}
    assert {n for n, p in backend.model.named_parameters() if p.requires_grad} == adapter
    original = dict(backend.named_weights())  # B starts at 0: the merged policy is the base
    saved = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, t in original.items():
        torch.testing.assert_close(t, saved[name], rtol=0, atol=0, msg=name)

    samples = make_samples(random_specs(1, 4, vocab(tiny_model_dir)))
    assert backend.train_step(samples)["grad_norm"] > 0
    after = params(backend)
    for name in before:  # B starts at 0, so A's gradient is 0 on the first step: only B moves
        assert (not torch.equal(before[name], after[name])) == (".lora_B." in name), name
    backend.train_step(samples)
    after = params(backend)
    for name in before:
        moved = not torch.equal(before[name], after[name])
        assert moved == (name in adapter), name  # every A and B moved, no base weight did
    merged = dict(backend.named_weights())
    assert set(merged) == set(original)  # the base model's own names, no lora_ or base_layer
    for name in merged:
        targeted = name.endswith(".weight") and name.rsplit(".", 2)[-2] in TARGETS
        assert (not torch.equal(merged[name], original[name])) == targeted, name


def test_merged_weights_are_the_policy_the_adapter_computes(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    backend = TorchBackend.load(tiny_model_dir, lora_cfg(alpha=8.0))
    samples = make_samples(random_specs(2, 3, vocab(tiny_model_dir)))
    backend.train_step(samples)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True)
    plain.load_state_dict(dict(backend.named_weights()), strict=False)  # lm_head is tied
    ids = torch.tensor([samples["input_ids"][0].as_py()])
    want = backend.sample_logprobs(samples)[0]
    with torch.no_grad():
        logits = plain(input_ids=ids).logits[0, :-1]
    got = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].numpy()
    np.testing.assert_allclose(got, want[1:], rtol=1e-5, atol=1e-5)  # float32, summed in another order


def test_kl_reference_is_the_base_with_the_adapter_off(tiny_model_dir: Path) -> None:
    from lgt.trainer.rl.algorithm import LossConfig

    cfg = TorchConfig(lr=1e-2, lora=LoraConfig(rank=4), loss=LossConfig(kl_coef=0.5))
    backend = TorchBackend.load(tiny_model_dir, cfg)
    assert backend.ref is None  # no second copy of the model
    samples = make_samples(random_specs(3, 3, vocab(tiny_model_dir)))
    first = backend.train_step(samples)
    assert first["loss/kl"] == pytest.approx(0.0, abs=1e-7)  # the adapter starts as a no-op
    backend.train_step(samples)
    assert backend.train_step(samples)["loss/kl"] > 1e-6  # the policy moved away from the base


def test_checkpoint_is_the_adapter_folder_and_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = lora_cfg(dropout=0.2)  # dropout draws from torch's RNG: the checkpoint restores it
    b1 = make_samples(random_specs(4, 5, vocab(tiny_model_dir)))
    b2 = make_samples(random_specs(5, 5, vocab(tiny_model_dir)))
    run = TorchBackend.load(tiny_model_dir, cfg)
    run.train_step(b1)
    ckpt = run.save_checkpoint(tmp_path / "ckpt", {"policy_version": 1})
    files = {p.name for p in ckpt.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "rng.pt",
            "trainer_state.json", "DONE", "tokenizer.json"} <= files
    assert not files & {"config.json", "model.safetensors", "README.md"}  # no full model in it
    adapter_cfg = json.loads((ckpt / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4 and adapter_cfg["lora_alpha"] == 16 and \
        sorted(adapter_cfg["target_modules"]) == TARGETS
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["base_model"] == str(tiny_model_dir.resolve())
    saved = {n: p.detach().clone() for n, p in run.model.named_parameters() if ".lora_" in n}
    expect = run.train_step(b2)

    resumed, extra = TorchBackend.resume(ckpt, cfg)
    assert extra == {"policy_version": 1} and resumed.step == 1 and resumed.lora == cfg.lora
    got = resumed.train_step(b2)
    assert got["loss"] == expect["loss"] and got["grad_norm"] == expect["grad_norm"]
    w_run, w_res = dict(run.named_weights()), dict(resumed.named_weights())
    for name in w_run:
        torch.testing.assert_close(w_res[name], w_run[name], rtol=0, atol=0, msg=name)
    assert len(resumed.optimizer.state) == len(run.optimizer.state) == 28

    # PEFT itself reads the checkpoint back onto the base (its init draws from the RNG: after the steps)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True)
    peft = PeftModel.from_pretrained(base, ckpt)
    read = {n: p for n, p in peft.named_parameters() if ".lora_" in n}
    assert set(read) == set(saved)
    for name, p in read.items():
        torch.testing.assert_close(p, saved[name], rtol=0, atol=0, msg=name)

    # the adapter saved on its own is the same folder a checkpoint holds
    alone = resumed.save_adapter(tmp_path / "adapter")
    assert sorted(p.name for p in alone.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_keep_checkpoints_prunes_adapter_checkpoints(tiny_model_dir: Path, tmp_path: Path) -> None:
    run_with_checkpoint(tiny_model_dir, tmp_path, lora_cfg(), steps=3)
    assert prune_checkpoints(tmp_path / "checkpoints", 1)
    assert [p.name for p in finished_checkpoints(tmp_path / "checkpoints")] == ["step-00000003"]


def test_resume_refuses_another_lora_setting(tiny_model_dir: Path, tmp_path: Path) -> None:
    full = TorchBackend.load(tiny_model_dir, TorchConfig()).save_checkpoint(tmp_path / "full")
    with pytest.raises(CheckpointError, match="holds a full model but backend.lora is set"):
        TorchBackend.resume(full, lora_cfg())
    adapter = TorchBackend.load(tiny_model_dir, lora_cfg()).save_checkpoint(tmp_path / "lora")
    with pytest.raises(CheckpointError, match="holds a LoRA adapter but backend.lora is not set"):
        TorchBackend.resume(adapter, TorchConfig())
    with pytest.raises(BackendError, match="does not fit backend.lora"):
        TorchBackend.resume(adapter, lora_cfg(rank=2))
    state = adapter / "trainer_state.json"  # the base it was trained on, gone
    state.write_text(json.dumps({**json.loads(state.read_text()), "base_model": str(tmp_path / "gone")}))
    with pytest.raises(CheckpointError, match="whose base model .* is gone"):
        TorchBackend.resume(adapter, lora_cfg())


def logprobs_of(model_dir: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].numpy()


def test_export_merge_gives_the_adapted_policys_logprobs(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    backend = run_with_checkpoint(tiny_model_dir, tmp_path / "run", lora_cfg(), steps=2)
    samples = make_samples(random_specs(7, 2, vocab(tiny_model_dir)))
    want = backend.sample_logprobs(samples)  # the model with the adapter applied (PEFT)
    base = [logprobs_of(tiny_model_dir, samples["input_ids"][i].as_py()) for i in range(2)]
    assert min(np.abs(b - w[1:]).max() for b, w in zip(base, want, strict=True)) > 0.05  # the adapter shows
    out = tmp_path / "merged"
    result = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--merge", str(out)])
    assert result.exit_code == 0, result.output
    assert "step-00000002's LoRA adapter merged" in result.output
    for i in range(2):
        ids = samples["input_ids"][i].as_py()
        # float32 sums in another order: |logprob| ~ 20 here, so ~1e-5 relative
        np.testing.assert_allclose(logprobs_of(out, ids), want[i][1:], rtol=1e-4, atol=1e-5)
    assert not (out / "adapter_config.json").exists() and (out / "config.json").is_file()
    tok, base_tok = (AutoTokenizer.from_pretrained(d, local_files_only=True) for d in (out, tiny_model_dir))
    assert tok.chat_template == base_tok.chat_template and tok.chat_template
    assert not list(tmp_path.glob(".*"))  # no temporary folder left

    # --step picks an older checkpoint: it differs from the latest
    older = tmp_path / "older"
    assert CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--step", "1",
                                     "--merge", str(older)]).exit_code == 0
    ids = samples["input_ids"][0].as_py()
    assert np.abs(logprobs_of(older, ids) - logprobs_of(out, ids)).max() > 1e-4


def test_export_of_a_full_model_run_copies_its_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = run_with_checkpoint(tiny_model_dir, tmp_path / "run", TorchConfig(lr=1e-2), steps=1)
    out = tmp_path / "out"
    out.mkdir()  # an empty folder is fine
    result = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--merge", str(out)])
    assert result.exit_code == 0, result.output
    assert not {"optimizer.pt", "rng.pt", "trainer_state.json", "DONE"} & {p.name for p in out.iterdir()}
    saved = load_file(str(out / "model.safetensors"))
    for name, t in backend.named_weights():
        torch.testing.assert_close(saved[name], t, rtol=0, atol=0, msg=name)


def test_export_bad_input_is_one_sentence_and_writes_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    def export(*args: str) -> str:
        result = CliRunner().invoke(main, ["export", *args])
        assert result.exit_code in (1, 2) and isinstance(result.exception, SystemExit), result.output
        assert result.output.startswith(("Error: ", "Usage: ")) and "Traceback" not in result.output
        return result.output

    out = str(tmp_path / "out")
    assert "is not a run folder" in export(str(tmp_path / "nope"), "--merge", out)
    (tmp_path / "empty-run").mkdir()
    (tmp_path / "empty-run" / "config.json").write_text("{}")
    assert "has no finished checkpoint (checkpoints/step-N" in \
        export(str(tmp_path / "empty-run"), "--merge", out)
    run_with_checkpoint(tiny_model_dir, tmp_path / "run", lora_cfg(), steps=2)
    assert "has no finished checkpoint of step 5: its steps are 1, 2" in \
        export(str(tmp_path / "run"), "--step", "5", "--merge", out)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "already exists and is not empty" in \
        export(str(tmp_path / "run"), "--merge", str(tmp_path / "full"))
    assert "--merge" in export(str(tmp_path / "run"))  # required
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*"))


def test_target_modules_the_model_lacks_are_named_with_the_ones_it_has(tiny_model_dir: Path) -> None:
    with pytest.raises(BackendError, match="names c_attn, which this Qwen2ForCausalLM does not have: the "
                                           "linear layers it has are " + ", ".join(TARGETS)):
        TorchBackend.load(tiny_model_dir, lora_cfg(target_modules=("q_proj", "c_attn")))
    backend = TorchBackend.load(tiny_model_dir, lora_cfg(target_modules=("q_proj", "v_proj")))
    assert sorted(backend.model.peft_config["default"].target_modules) == ["q_proj", "v_proj"]


@pytest.mark.parametrize(("override", "message"), [
    ({"backend.lora.rank": 0}, "backend.lora.rank must be a positive integer, not 0"),
    ({"backend.lora.alpha": -1}, "backend.lora.alpha must be a finite number > 0"),
    ({"backend.lora.dropout": 1}, r"backend.lora.dropout must be a number in \[0, 1\), not 1"),
    ({"backend.lora.target_modules": []}, "backend.lora.target_modules must be a list of module names"),
    ({"backend.lora.rank": 4, "backend.train_layers": 1}, "backend.lora and backend.train_layers"),
    ({"backend.name": "verl", "backend.lora.dropout": 0.1}, "verl's LoRA has no dropout"),
])
def test_config_refuses_bad_lora_settings(override: dict, message: str) -> None:
    with pytest.raises(cfgmod.ConfigError, match=message):
        cfgmod.load(EXAMPLE, override)


def test_lora_is_read_from_yaml_and_fixed_on_resume(tmp_path: Path) -> None:
    cfg = cfgmod.load(EXAMPLE, {"backend.lora": {"rank": 16, "target_modules": "q_proj v_proj"}})
    assert cfg.backend.lora == LoraConfig(rank=16, alpha=16.0, dropout=0.0,
                                          target_modules=("q_proj", "v_proj"))
    assert cfgmod.load(EXAMPLE).backend.lora is None  # full fine-tuning, as before
    (tmp_path / cfgmod.RUN_FILE).write_text(json.dumps(cfg.to_json()))
    assert cfgmod.saved(tmp_path).backend.lora == cfg.backend.lora
    with pytest.raises(cfgmod.ConfigError, match="backend.lora was .* cannot be resumed"):
        cfgmod.saved(tmp_path, {"backend.lora.rank": 8})


def test_run_refuses_to_start_from_an_adapter_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    run_with_checkpoint(tiny_model_dir, tmp_path / "run", lora_cfg(), steps=1)
    result = CliRunner().invoke(main, ["run", str(EXAMPLE), "--checkpoint", str(tmp_path / "run")])
    assert result.exit_code != 0
    assert "holds a LoRA adapter, not a model to start from: lgt-train export" in result.output
    assert not (tmp_path / "run" / "checkpoints" / "step-00000001" / "config.json").exists()


def test_preflight_names_missing_targets_before_anything_starts(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from lgt.trainer import preflight
    from lgt.trainer.backends.lora import targetable
    from lgt.trainer.model_dir import linear_layer_names

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    # the weights files' headers (no torch) name what the loaded model's modules are
    assert linear_layer_names(tiny_model_dir, vocab(tiny_model_dir)) == targetable(model) == TARGETS
    assert linear_layer_names(tmp_path) is None  # no safetensors file: cannot tell
    run_dir = tmp_path / "run"
    bad = {"model.path": str(tiny_model_dir), "model.make": None, "run_dir": str(run_dir),
           "backend.lora.target_modules": ["q_proj", "c_attn"]}
    with pytest.raises(cfgmod.ConfigError, match="names c_attn, which this Qwen2ForCausalLM does not have: "
                                                 "the linear layers it has are " + ", ".join(TARGETS)):
        preflight.check_lora(cfgmod.load(EXAMPLE, bad))
    result = CliRunner().invoke(main, ["run", str(EXAMPLE), *(f"--set={k}={json.dumps(v)}"
                                                              for k, v in bad.items())])
    assert result.exit_code == 1 and "names c_attn, which this Qwen2ForCausalLM" in result.output
    assert not run_dir.exists()  # refused before the run's folder was made
    preflight.check_lora(cfgmod.load(EXAMPLE, {**bad, "backend.lora.target_modules": ["q_proj"]}))


@pytest.mark.slow
def test_a_lora_run_serves_its_adapter_and_resumes(tmp_path: Path, arith_model_dir: Path) -> None:
    """``lgt-train run`` with ``backend.lora`` on its own engine, one step, then ``--resume`` to a second:
    the engine restarted on the base model gets the step-1 adapter loaded before its first call."""
    from lgt.store.query import connect
    from lgt.testing.runs import lgt_train, lgt_train_cmd, metrics, write_config

    run_dir = tmp_path / "run"
    # max_staleness 0: step 2 trains only calls of policy version 1, made after the resume
    cfg = write_config(tmp_path, arith_model_dir, steps=1, max_staleness=0,
                       backend={"lr": 1e-2, "lora": {"rank": 8}})
    out = lgt_train(str(cfg), "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(a LoRA adapter of rank 8 on down_proj, gate_proj" in out.stderr
    ckpt = run_dir / "checkpoints" / "step-00000001"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    # an adapter far from a no-op (one step on the barely warm model's rewards, mostly 0, hardly moves
    # it): the checkpoint rewritten with random B matrices, the rest as the run left it
    cfg_lora = TorchConfig(lora=LoraConfig(rank=8))
    backend, extra = TorchBackend.resume(ckpt, cfg_lora)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in backend.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.05)
    assert backend.save_checkpoint(run_dir / "checkpoints", extra, name=1) == ckpt
    out = lgt_train(str(cfg), "--resume", str(run_dir), "--steps", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from step-00000001: step 1, policy version 1" in out.stderr
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]

    # the calls of policy version 1, served after the restart (the engine started on the base, the
    # adapter loaded as policy-v1), sampled from the step-1 adapter's policy, not from the base
    rows = connect(run_dir / "store").execute(
        "SELECT prompt_token_ids, response_token_ids, response_logprobs FROM calls "
        "WHERE policy_version = 1 AND len(response_token_ids) > 0").fetchall()
    assert len(rows) >= 4
    served = connect(run_dir / "store").execute(
        "SELECT DISTINCT served_model FROM calls WHERE policy_version = 1").fetchall()
    assert served == [("policy-v1",)]
    specs = [(p + r, [0] * len(p) + [1] * len(r), 1.0) for p, r, _ in rows]
    adapted = backend.sample_logprobs(make_samples(specs))
    base = TorchBackend.load(arith_model_dir, TorchConfig()).sample_logprobs(make_samples(specs))
    recorded = [np.asarray(lp, np.float32) for _, _, lp in rows]
    gap = max(float(np.abs(a[len(p):] - r).max()) for a, (p, _, _), r in zip(adapted, rows, recorded,
                                                                                strict=True))
    from_base = max(float(np.abs(b[len(p):] - r).max()) for b, (p, _, _), r in zip(base, rows, recorded,
                                                                                   strict=True))
    assert gap < 1e-3 < from_base, (gap, from_base)

    # lgt-train eval serves a LoRA checkpoint's adapter on its base: its calls sample from the adapter
    eval_dir = tmp_path / "eval"
    out = lgt_train_cmd("eval", str(cfg), "--checkpoint", str(ckpt), "--run-dir", str(eval_dir),
                        "--set", "eval.split=0.1", "--set", "eval.samples=1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert connect(eval_dir / "store").execute("SELECT DISTINCT served_model FROM calls").fetchall() == [
        ("policy-v1",)]
    assert "eval at step 1" in out.stdout
    rows = connect(eval_dir / "store").execute(
        "SELECT prompt_token_ids, response_token_ids, response_logprobs FROM calls "
        "WHERE len(response_token_ids) > 0 AND sampling IS DISTINCT FROM 'greedy'").fetchall()
    assert rows
    adapted = backend.sample_logprobs(make_samples([(p + r, [0] * len(p) + [1] * len(r), 1.0)
                                                    for p, r, _ in rows]))
    assert max(float(np.abs(a[len(p):] - np.asarray(lp, np.float32)).max())
               for a, (p, _, lp) in zip(adapted, rows, strict=True)) < 1e-3


def test_sft_summary_says_how_to_use_an_adapter_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    from lgt.trainer.distill.sft import summary_lines

    summary = {"rollouts_read": 1, "rollouts_kept": 1, "calls": 1, "samples": 1, "tokens_trained": 1,
               "merge_breaks": 0, "bad_traces": 0, "nll_first": 1.0, "nll_last": 0.5, "steps": 1,
               "minutes": 0.1}
    adapter = TorchBackend.load(tiny_model_dir, lora_cfg()).save_checkpoint(tmp_path / "a" / "checkpoints")
    full = TorchBackend.load(tiny_model_dir, TorchConfig()).save_checkpoint(tmp_path / "f" / "checkpoints")
    assert summary_lines({**summary, "checkpoint": str(adapter)})[-1] == (
        f"checkpoint: {adapter} (a LoRA adapter: lgt-train export {tmp_path / 'a'} --merge DIR makes it a "
        "model.path)")
    assert summary_lines({**summary, "checkpoint": str(full)})[-1].endswith("(use it as model.path of a run)")


def test_gradient_checkpointing_gives_the_adapter_the_same_gradient(tiny_model_dir: Path) -> None:
    batch = make_samples(random_specs(10, 4, vocab(tiny_model_dir)))
    plain = TorchBackend.load(tiny_model_dir, lora_cfg(micro_batch_tokens=4096))
    ckpt = TorchBackend.load(tiny_model_dir, replace(lora_cfg(), grad_checkpointing=True))
    assert ckpt.model.is_gradient_checkpointing
    plain.accumulate(batch)
    ckpt.accumulate(batch)  # and in micro-batches of 64 padded tokens
    g_plain = {n: p.grad for n, p in plain.model.named_parameters() if p.grad is not None}
    g_ckpt = {n: p.grad for n, p in ckpt.model.named_parameters() if p.grad is not None}
    assert set(g_ckpt) == set(g_plain) == {n for n, _ in plain.model.named_parameters() if ".lora_" in n}
    for name, g in g_ckpt.items():  # A's gradient is 0 while B is
        assert (float(g.abs().max()) > 0) == (".lora_B." in name), name
        torch.testing.assert_close(g, g_plain[name], rtol=1e-4, atol=1e-7, msg=name)
