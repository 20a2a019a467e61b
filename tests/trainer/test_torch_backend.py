"""TorchBackend on the tiny random Qwen2: updates go the right way, micro-batching and padding change
nothing, checkpoints resume exactly, bad samples fail in one sentence before any gradient."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lgt.store.samples import SAMPLES
from lgt.trainer.backends.samples import SampleError
from lgt.trainer.backends.torch_backend import (
    CheckpointError,
    SampleTooLongError,
    TorchBackend,
    TorchConfig,
    latest_checkpoint,
    pack_micro_batches,
)
from lgt.trainer.rl import loss as rl
from lgt.trainer.rl.algorithm import training_schema

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "rollout")


Spec = tuple[list[int], list[int], float]  # input_ids, loss_mask, advantage


def make_samples(specs: list[Spec], *, behaviour: list[list[float]] | None = None,
                 weights: list[float] | None = None) -> pa.Table:
    """SAMPLES rows from (input_ids, loss_mask, advantage) triples; each sample its own rollout.

    loss_weight defaults to the store's rule, 1 / (R * masked tokens of the rollout)."""
    rows = []
    for i, (ids, mask, adv) in enumerate(specs):
        masked = max(sum(mask), 1)
        rows.append({
            "sample_id": f"r{i}~0#0", "rollout_id": f"r{i}", "attempt": 0, "group_id": "g", "task_id": "t",
            "sample_index": 0, "n_calls": 1, "input_ids": ids, "loss_mask": mask,
            "behaviour_logprobs": behaviour[i] if behaviour else [0.0] * len(ids),
            "policy_versions": [0 if m else -1 for m in mask], "reward": adv, "advantage": adv,
            "loss_weight": weights[i] if weights else 1.0 / (len(specs) * masked),
            "rollout_tokens": masked, "group_size": len(specs), "zero_variance": False, "mode": "exact"})
    return pa.Table.from_pylist(rows, schema=training_schema(SAMPLES))


def random_specs(seed: int, n: int, vocab: int, *, lo: int = 6, hi: int = 40) -> list[Spec]:
    """n samples of random length in [lo, hi): a prompt then generated tokens (mask 1), advantages +-."""
    rng = np.random.default_rng(seed)
    specs = []
    for i in range(n):
        length = int(rng.integers(lo, hi))
        prompt = int(rng.integers(2, length - 1))
        ids = rng.integers(3, vocab, size=length).tolist()
        mask = [0] * prompt + [1] * (length - prompt)
        specs.append((ids, mask, 1.0 if i % 2 == 0 else -1.0))
    return specs


def on_policy(backend: TorchBackend, specs, **kw) -> pa.Table:
    """The samples with behaviour log-probs equal to the policy's own (masked positions only)."""
    logps = backend.sample_logprobs(make_samples(specs, **kw))
    behaviour = [(lp * np.asarray(m, np.float32)).tolist()
                 for lp, (_, m, _) in zip(logps, specs, strict=True)]
    return make_samples(specs, behaviour=behaviour, **kw)


def grads(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}


def weights(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in backend.named_weights()}


def assert_close_scaled(a: torch.Tensor, b: torch.Tensor, name: str, rel: float = 1e-4) -> None:
    """|a - b| <= rel * max|b| elementwise: float32 sums in another order differ by rounding only."""
    scale = float(b.abs().max())
    assert float((a - b).abs().max()) <= rel * scale + 1e-12, (name, float((a - b).abs().max()), scale)


def vocab(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="backend.lr must be a finite number > 0"):
        TorchConfig(lr=0.0)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        TorchConfig(micro_batch_tokens=0)
    with pytest.raises(ValueError, match="dtype"):
        TorchConfig(dtype="float8")
    with pytest.raises(ValueError, match="ref_model is false"):
        TorchConfig(loss=rl.LossConfig(kl_coef=0.1), ref_model=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 1000))
def test_pack_micro_batches_covers_all_within_budget(lengths: list[int], budget: int) -> None:
    bins = pack_micro_batches(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        cost = len(b) * max(lengths[i] for i in b)
        assert cost <= budget or len(b) == 1  # a sample over the budget sits alone
    assert bins == pack_micro_batches(lengths, budget)


def test_pack_micro_batches_first_fit_decreasing() -> None:
    # sorted: 8(i1), 5(i0), 4(i3), 2(i2); budget 16: [8, 5] costs 16; 4 then opens a bin with 2
    assert pack_micro_batches([5, 8, 2, 4], 16) == [[1, 0], [3, 2]]


def test_steps_raise_positive_and_lower_negative_logprobs(tiny_model_dir: Path) -> None:
    backend = TorchBackend.load(tiny_model_dir, TorchConfig(lr=2e-3, micro_batch_tokens=64))
    specs = random_specs(0, 6, vocab(tiny_model_dir))
    batch = on_policy(backend, specs)  # behaviour = the starting policy: the IS weight grows with the update

    def mean_logp(sign: float) -> float:
        lps = backend.sample_logprobs(batch)
        vals = [lp[np.asarray(m) == 1] for lp, (_, m, a) in zip(lps, specs, strict=True) if a * sign > 0]
        return float(np.concatenate(vals).mean())

    pos0, neg0 = mean_logp(+1), mean_logp(-1)
    backend_start_logps = backend.sample_logprobs(batch)
    first = backend.train_step(batch)
    # Training scores the same tokens as sample_logprobs (logits at trained positions only there):
    # on-policy behaviour log-probs give old - behaviour = 0 and IS weights 1 on the first step.
    assert first["actor/behaviour_kl"] == pytest.approx(0.0, abs=1e-5)
    assert first["actor/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    masked = np.concatenate([lp[np.asarray(m) == 1] for lp, (_, m, _) in
                             zip(backend_start_logps, specs, strict=True)])
    assert first["actor/neg_logprob"] == pytest.approx(-float(masked.mean()), rel=1e-5)
    losses = [first["loss"]] + [backend.train_step(batch)["loss"] for _ in range(4)]
    pos1, neg1 = mean_logp(+1), mean_logp(-1)
    assert backend.step == 5
    assert losses[-1] < losses[0]
    assert pos1 > pos0 + 0.05
    assert neg1 < neg0 - 0.05


def test_epochs_clip_later_passes_against_the_first(tiny_model_dir: Path) -> None:
    """epochs=3: three optimizer steps on one batch, one training step; passes 2 and 3 take the first
    pass's log-probs as the old policy (ratio != 1, clipped where it moved too far), so a pass never
    pushes a token further than the clip range from where the batch started."""
    specs = random_specs(3, 6, vocab(tiny_model_dir))
    one = TorchBackend.load(tiny_model_dir, TorchConfig(lr=5e-2, micro_batch_tokens=64, seed=0))
    batch = on_policy(one, specs)
    m1 = one.train_step(batch)
    assert m1["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m1["actor/clipfrac"] == 0.0
    three = TorchBackend.load(tiny_model_dir, TorchConfig(lr=5e-2, micro_batch_tokens=64, seed=0, epochs=3))
    m3 = three.train_step(batch)
    assert three.step == 1  # one training step, however many passes
    assert m3["actor/ratio_mean"] != pytest.approx(1.0, abs=1e-3)  # the last pass saw a moved policy
    assert m3["actor/clipfrac"] > 0.0
    after_one, after_three = weights(one), weights(three)
    assert any(not torch.equal(after_three[n], after_one[n]) for n in after_one)  # more updates made
    with pytest.raises(ValueError, match="backend.epochs"):
        TorchConfig(epochs=0)


def test_missing_behaviour_logprobs_train_as_on_policy(tiny_model_dir: Path) -> None:
    # A call the proxy recorded without logprobs reaches the trainer as NaN behaviour logprobs: the
    # update recomputes them (the policy's own, before the step), exactly what on-policy ones give.
    specs = random_specs(1, 4, vocab(tiny_model_dir))
    grads_of = {}
    for kind in ("recorded", "missing"):
        backend = TorchBackend.load(tiny_model_dir, TorchConfig(lr=1e-3, micro_batch_tokens=64))
        batch = on_policy(backend, specs)
        if kind == "missing":
            batch = make_samples(specs, behaviour=[[math.nan if m else 0.0 for m in mask]
                                                   for _, mask, _ in specs])
        backend.optimizer.zero_grad(set_to_none=True)
        out = backend.accumulate(batch)
        assert math.isfinite(out["loss"])
        assert out["actor/behaviour_recomputed_frac"] == (1.0 if kind == "missing" else 0.0)
        grads_of[kind] = grads(backend)
    for name, g in grads_of["recorded"].items():
        assert_close_scaled(grads_of["missing"][name], g, name)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batches_add_up_to_the_whole_batch(tiny_model_dir: Path, agg: str) -> None:
    specs = random_specs(1, 7, vocab(tiny_model_dir))
    specs.append((specs[0][0], [0] * len(specs[0][0]), 1.0))  # no trained token: counts as a sample only
    cfg = TorchConfig(lr=1e-3, grad_clip=None, loss=rl.LossConfig(agg=agg))
    one = TorchBackend.load(tiny_model_dir, cfg)  # budget 4096: all in one padded micro-batch
    many = TorchBackend.load(tiny_model_dir, replace(cfg, micro_batch_tokens=40))
    batch = on_policy(one, specs)
    batch = batch.set_column(batch.schema.get_field_index("behaviour_logprobs"), "behaviour_logprobs",
                             pc_add_noise(batch.column("behaviour_logprobs")))  # IS weights != 1

    m_one = one.accumulate(batch)
    m_many = many.accumulate(batch)
    assert m_one["micro_batches"] == 1 and m_many["micro_batches"] >= 5
    assert m_one["loss"] == pytest.approx(m_many["loss"], rel=1e-4, abs=1e-6)
    g_one, g_many = grads(one), grads(many)
    assert g_one.keys() == g_many.keys() and g_one
    assert max(float(g.abs().max()) for g in g_one.values()) > 1e-4  # a gradient worth comparing
    for name in g_one:
        assert_close_scaled(g_many[name], g_one[name], name)

    # The full step (clip + AdamW) too. Adam's first step is ~lr*sign(g), which turns rounding noise on
    # near-zero gradients into +-lr; eps=1 makes the update ~lr*g, so the weights follow the gradient
    # (lr=1 keeps the update well above the float32 rounding of the weights).
    cfg = TorchConfig(lr=1.0, eps=1.0, grad_clip=0.05, loss=rl.LossConfig(agg=agg))
    start = weights(one)
    one = TorchBackend.load(tiny_model_dir, cfg)
    many = TorchBackend.load(tiny_model_dir, replace(cfg, micro_batch_tokens=40))
    m_one, m_many = one.train_step(batch), many.train_step(batch)
    assert m_one["grad_norm"] > 0.05  # clipping was applied
    assert m_one["grad_norm"] == pytest.approx(m_many["grad_norm"], rel=1e-4)
    w_one, w_many = weights(one), weights(many)
    biggest = max(float((w - start[n]).abs().max()) for n, w in w_one.items())
    assert biggest > 1e-3
    for name in w_one:  # within rounding of the weights (float32: ~1e-7 of |w| ~ 1)
        assert not torch.equal(w_one[name], start[name])
        assert float((w_many[name] - w_one[name]).abs().max()) <= 1e-4 * biggest, name


def pc_add_noise(col: pa.ChunkedArray) -> pa.Array:
    """behaviour log-probs shifted by a fixed pseudo-random amount on the masked (non-zero) entries."""
    arr = col.combine_chunks()
    values = arr.values.to_numpy().copy()
    rng = np.random.default_rng(7)
    values = np.where(values != 0, values + rng.normal(0, 0.3, len(values)).astype(np.float32), 0)
    return pa.ListArray.from_arrays(arr.offsets, pa.array(values, pa.float32()))


def test_gradient_checkpointing_gives_the_same_gradient(tiny_model_dir: Path) -> None:
    batch = make_samples(random_specs(10, 4, vocab(tiny_model_dir)))
    plain = TorchBackend.load(tiny_model_dir, TorchConfig())
    ckpt = TorchBackend.load(tiny_model_dir, TorchConfig(grad_checkpointing=True))
    assert ckpt.model.is_gradient_checkpointing
    plain.accumulate(batch)
    ckpt.accumulate(batch)
    g_plain = grads(plain)
    for name, g in grads(ckpt).items():
        assert_close_scaled(g, g_plain[name], name)


def test_padding_does_not_change_logprobs_or_gradient(tiny_model_dir: Path) -> None:
    v = vocab(tiny_model_dir)
    short, long_ = random_specs(2, 1, v, lo=8, hi=9)[0], random_specs(3, 1, v, lo=30, hi=31)[0]
    cfg = TorchConfig(micro_batch_tokens=4096, loss=rl.LossConfig(agg="rollout"))
    backend = TorchBackend.load(tiny_model_dir, cfg)
    alone = backend.sample_logprobs(make_samples([short]))[0]
    padded = backend.sample_logprobs(make_samples([long_, short]))[1]  # padded from 8 to 30 tokens
    assert pack_micro_batches([30, 8], cfg.micro_batch_tokens) == [[0, 1]]
    np.testing.assert_allclose(padded, alone, rtol=1e-5, atol=1e-5)
    assert np.all(alone[1:] < 0) and alone[0] == 0

    # Rollout weighting with fixed weights: grad(short padded next to long, long's weight 0) == grad(short).
    backend.accumulate(make_samples([short], weights=[0.1]))
    g_alone = grads(backend)
    backend.optimizer.zero_grad(set_to_none=True)
    backend.accumulate(make_samples([long_, short], weights=[0.0, 0.1]))
    for name, g in grads(backend).items():
        assert_close_scaled(g, g_alone[name], name)


def test_resume_continues_exactly_and_ignores_unfinished(tiny_model_dir: Path, tmp_path: Path) -> None:
    v = vocab(tiny_model_dir)
    cfg = TorchConfig(lr=1e-3, micro_batch_tokens=64)
    b1 = make_samples(random_specs(4, 5, v))
    b2 = make_samples(random_specs(5, 5, v))
    run = TorchBackend.load(tiny_model_dir, cfg)
    run.train_step(b1)
    ckpt = run.save_checkpoint(tmp_path / "ckpt", {"trained": ["r0~0#0"], "policy_version": 1})
    run.train_step(b2)

    assert ckpt.name == "step-00000001" and (ckpt / "DONE").is_file()
    assert latest_checkpoint(tmp_path / "ckpt") == ckpt
    resumed, extra = TorchBackend.resume(ckpt, cfg)
    assert extra == {"trained": ["r0~0#0"], "policy_version": 1} and resumed.step == 1
    resumed.train_step(b2)
    assert resumed.step == run.step == 2
    w_run, w_res = weights(run), weights(resumed)
    for name in w_run:
        torch.testing.assert_close(w_res[name], w_run[name], rtol=0, atol=1e-7, msg=name)

    # A later checkpoint without DONE (a crash mid-write) is ignored and refused.
    unfinished = tmp_path / "ckpt" / "step-00000002"
    shutil.copytree(ckpt, unfinished)
    (unfinished / "DONE").unlink()
    assert latest_checkpoint(tmp_path / "ckpt") == ckpt
    assert latest_checkpoint(tmp_path / "nothing-here") is None
    with pytest.raises(CheckpointError, match="no DONE file"):
        TorchBackend.resume(unfinished, cfg)

    # a run names the folder by its own step (one step may make several updates); resume restores the
    # backend's update count all the same
    named = resumed.save_checkpoint(tmp_path / "ckpt", {"step": 1}, name=1)
    assert named.name == "step-00000001" and TorchBackend.resume(named, cfg)[0].step == 2


def test_checkpoint_is_a_hugging_face_model_dir(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = TorchBackend.load(tiny_model_dir, TorchConfig())
    ckpt = backend.save_checkpoint(tmp_path)
    tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True)
    for name, t in model.named_parameters():
        torch.testing.assert_close(t, dict(backend.named_weights())[name], rtol=0, atol=0)
    assert not list(tmp_path.glob(".*"))  # no temporary directory left behind


def test_named_weights_are_hf_names_with_tied_embedding_once(tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    backend = TorchBackend.load(tiny_model_dir, TorchConfig())
    names = [n for n, _ in backend.named_weights()]
    assert backend.tied_lm_head
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names))
    saved = load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(names) == set(saved) - {"lm_head.weight"}


def test_too_long_sample_fails_before_any_gradient(tiny_model_dir: Path) -> None:
    v = vocab(tiny_model_dir)
    backend = TorchBackend.load(tiny_model_dir, TorchConfig(max_seq_len=16))
    before = weights(backend)
    specs = random_specs(6, 3, v, lo=6, hi=12) + [(list(range(3, 23)), [0] * 10 + [1] * 10, 1.0)]
    with pytest.raises(SampleTooLongError) as err:
        backend.train_step(make_samples(specs))
    assert str(err.value).startswith("sample r3~0#0 has 20 tokens, more than max_seq_len 16")
    assert all(p.grad is None for p in backend.model.parameters())
    assert all(torch.equal(t, before[n]) for n, t in backend.named_weights()) and backend.step == 0


def test_all_zero_loss_mask_makes_no_update_and_no_nan(tiny_model_dir: Path) -> None:
    backend = TorchBackend.load(tiny_model_dir, TorchConfig())
    before = weights(backend)
    specs = [(ids, [0] * len(ids), a) for ids, _, a in random_specs(7, 3, vocab(tiny_model_dir))]
    metrics = backend.train_step(make_samples(specs))
    assert metrics["skipped"] == 1.0 and metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0
    assert all(np.isfinite(v) for v in metrics.values())
    assert all(torch.equal(t, before[n]) for n, t in backend.named_weights()) and backend.step == 1


def test_bad_samples_fail_in_one_sentence(tiny_model_dir: Path) -> None:
    backend = TorchBackend.load(tiny_model_dir, TorchConfig())
    good = make_samples(random_specs(8, 2, vocab(tiny_model_dir)))
    bad_len = good.set_column(good.schema.get_field_index("loss_mask"), "loss_mask",
                              pa.array([[1, 0], [1]], pa.list_(pa.int8())))
    with pytest.raises(SampleError, match=r"sample r0~0#0 has \d+ input_ids but 2 loss_mask"):
        backend.train_step(bad_len)
    ids = good.column("input_ids").to_pylist()
    ids[1][-1] = 10**6
    with pytest.raises(SampleError, match="sample r1~0#0 holds token id 1000000, outside the model's vocab"):
        backend.train_step(good.set_column(good.schema.get_field_index("input_ids"), "input_ids",
                                           pa.array(ids, pa.list_(pa.int32()))))
    with pytest.raises(SampleError, match="lack column"):
        backend.train_step(good.drop_columns(["advantage"]))
    assert backend.step == 0


def test_kl_reference_is_the_starting_policy(tiny_model_dir: Path) -> None:
    cfg = TorchConfig(lr=1e-3, loss=rl.LossConfig(kl_coef=0.5, agg="token-mean"))
    backend = TorchBackend.load(tiny_model_dir, cfg)
    assert backend.ref is not None
    batch = make_samples(random_specs(9, 4, vocab(tiny_model_dir)))
    first = backend.train_step(batch)
    assert first["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    second = backend.train_step(batch)
    assert second["loss/kl"] > 0


def test_bfloat16_autocast_keeps_float32_weights(tiny_model_dir: Path) -> None:
    backend = TorchBackend.load(tiny_model_dir, TorchConfig(dtype="bfloat16", device="cpu"))
    metrics = backend.train_step(make_samples(random_specs(11, 3, vocab(tiny_model_dir))))
    assert all(np.isfinite(v) for v in metrics.values()) and metrics["grad_norm"] > 0
    assert all(t.dtype == torch.float32 for _, t in backend.named_weights())


AVX512_HOST = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\nmodel name\t: EPYC\n"
AMX_HOST = "flags\t\t: fpu avx2 amx_tile amx_bf16 amx_int8\n"
AVX2_HOST = "flags\t\t: fpu sse2 avx2 fma\nmodel name\t: something avx512_bf16-ish\n"


def test_dtype_auto_is_bfloat16_only_where_the_cpu_has_it_natively() -> None:
    from lgt.trainer.serving.hardware import resolve_dtype
    from lgt.trainer.serving.launch import engine_dtype

    assert resolve_dtype("auto", cpuinfo=AVX512_HOST) == ("bfloat16", "dtype auto: this CPU has avx512_bf16")
    assert resolve_dtype("auto", cpuinfo=AMX_HOST)[0] == "bfloat16"
    # only the flags line counts; without either flag bf16 is emulated: float32, and the line says why
    dtype, why = resolve_dtype("auto", key="backend.dtype", cpuinfo=AVX2_HOST)
    assert dtype == "float32" and why.startswith("backend.dtype auto: this CPU has neither avx512_bf16")
    assert resolve_dtype("auto", cpuinfo="")[0] == "float32"  # no /proc/cpuinfo (macOS)
    assert resolve_dtype("bfloat16", cpuinfo=AVX2_HOST) == ("bfloat16", "dtype bfloat16")  # asked for: kept
    # the engine: unset stays float32 on CPU and the model's own on a GPU; auto as above
    assert engine_dtype(None, cpu=True)[0] == "float32" and engine_dtype(None, cpu=False)[0] is None
    assert engine_dtype("auto", cpu=True, cpuinfo=AVX512_HOST)[0] == "bfloat16"
    assert engine_dtype("auto", cpu=True, cpuinfo=AVX2_HOST)[0] == "float32"
    assert TorchConfig(dtype="auto").dtype == "auto" and TorchConfig().dtype == "float32"


def test_backend_says_which_dtype_it_chose(tiny_model_dir: Path) -> None:
    from lgt.trainer.serving.hardware import resolve_dtype

    backend = TorchBackend.load(tiny_model_dir, TorchConfig(dtype="auto", device="cpu"))
    assert backend.dtype == resolve_dtype("auto")[0]  # this machine's answer
    assert f"({resolve_dtype('auto', key='backend.dtype')[1]})" in backend.summary
    assert backend.summary.endswith("training every parameter")


def test_train_layers_trains_only_the_top_layers_and_the_final_norm(tiny_model_dir: Path) -> None:
    backend = TorchBackend.load(tiny_model_dir, TorchConfig(device="cpu", lr=1e-2, train_layers=1))
    names = {n for n, _ in backend.model.named_parameters()}
    trained = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    # the tiny model has 2 layers: layer 1 and the norm after it; the tied embedding stays frozen
    assert trained == {n for n in names if n.startswith("model.layers.1.")} | {"model.norm.weight"}
    assert backend.summary.endswith("parameters (the top 1 of 2 layers + final norm)")
    assert sum(len(g["params"]) for g in backend.optimizer.param_groups) == len(trained)
    before = weights(backend)
    backend.train_step(make_samples(random_specs(12, 4, vocab(tiny_model_dir))))
    changed = {n for n, t in backend.named_weights() if not torch.equal(t, before[n])}
    assert changed <= trained and {"model.layers.1.mlp.down_proj.weight", "model.norm.weight"} <= changed
    assert {id(p) for p in backend.optimizer.state} <= {id(p) for p in backend.model.parameters()
                                                         if p.requires_grad}
    assert len(dict(backend.named_weights())) == len(before)  # the engine still gets the whole model

    with_emb = TorchBackend.load(tiny_model_dir, TorchConfig(device="cpu", train_layers=2,
                                                             train_embeddings=True))
    assert all(p.requires_grad for p in with_emb.model.parameters())
    assert with_emb.summary.endswith("training every parameter (the top 2 of 2 layers + final norm + "
                                     "embeddings)")


def test_train_layers_refuses_what_it_cannot_freeze(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from lgt.trainer.backends.torch_backend import freeze_below

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    with pytest.raises(ValueError, match=r"^backend.train_layers needs a model whose decoder layers are "
                                         r"model.model.layers .* this GPT2LMHeadModel has none"):
        freeze_below(gpt2, 1)
    with pytest.raises(ValueError, match="backend.train_layers is 3 but the model has 2 decoder layers"):
        TorchBackend.load(tiny_model_dir, TorchConfig(device="cpu", train_layers=3))
    with pytest.raises(ValueError, match="backend.train_layers must be a positive integer or null"):
        TorchConfig(train_layers=0)
    # a checkpoint resumed with other trained parameters: one sentence, not torch's
    partial = TorchBackend.load(tiny_model_dir, TorchConfig(device="cpu", train_layers=1))
    ckpt = partial.save_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="optimizer state is for another set of trained parameters"):
        TorchBackend.resume(ckpt, TorchConfig(device="cpu"))
