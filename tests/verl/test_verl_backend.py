"""The verl backend: samples -> DataProto conversion, config, verl's loss under the weight folding, and
verl's FSDP actor updating a tiny model (on CPU through the backend's CPU platform; on CUDA with ``gpu``).

Run in verl's environment: ``.venv-verl/bin/python -m pytest -q tests/verl``.
"""

from __future__ import annotations

import math

import pytest

# "verl.protocol", not "verl": with tests/ on sys.path this folder would pass for a namespace package "verl"
pytest.importorskip("verl.protocol")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lgt.store.samples import SAMPLES  # noqa: E402
from lgt.trainer.backends.base import LoraConfig  # noqa: E402
from lgt.trainer.backends.samples import SampleError  # noqa: E402
from lgt.trainer.backends.verl_actor import VerlConfig, VerlConfigError, VerlInProcessActor  # noqa: E402
from lgt.trainer.backends.verl_batch import samples_to_dataproto  # noqa: E402
from lgt.trainer.rl.algorithm import LossConfig, training_schema  # noqa: E402

PAD = 0


def sample(sid: str, segments: list[tuple[str, list[int]]], *, advantage: float = 1.0,
           loss_weight: float = 0.1, logprob=lambda t: -0.01 * t) -> dict:
    """A SAMPLES row from ("ctx" | "gen", tokens) segments; generated tokens get logprob(token)."""
    ids, mask, lps, versions = [], [], [], []
    for kind, toks in segments:
        gen = kind == "gen"
        ids += toks
        mask += [int(gen)] * len(toks)
        lps += [logprob(t) if gen else 0.0 for t in toks]
        versions += [3 if gen else -1 for _ in toks]
    return dict(sample_id=sid, rollout_id=f"r-{sid}", attempt=0, group_id="g", task_id="t", sample_index=0,
                n_calls=sum(k == "gen" for k, _ in segments), input_ids=ids, loss_mask=mask,
                behaviour_logprobs=lps, policy_versions=versions, reward=1.0, advantage=advantage,
                loss_weight=loss_weight, rollout_tokens=sum(mask), group_size=2, zero_variance=False,
                mode="exact")


def table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=training_schema(SAMPLES))


def unpack(dp, i: int) -> tuple[list[int], list[int], list[float]]:
    """Row i of a DataProto back to (input_ids, loss_mask, behaviour_logprobs) over its real tokens."""
    b = dp.batch
    width_p = b["prompts"].shape[1]
    attn = b["attention_mask"][i].bool()
    ids = b["input_ids"][i][attn].tolist()
    resp_real = attn[width_p:]
    mask = [0] * int(attn[:width_p].sum()) + b["response_mask"][i][resp_real].tolist()
    lps = [0.0] * int(attn[:width_p].sum()) + b["old_log_probs"][i][resp_real].tolist()
    return ids, mask, lps


# -- conversion ------------------------------------------------------------------------------------


def test_single_turn_shapes_padding_and_positions():
    rows = [sample("a", [("ctx", [11, 12, 13]), ("gen", [21, 22])]),
            sample("b", [("ctx", [31]), ("gen", [41, 42, 43, 44])], advantage=-0.5)]
    dp = samples_to_dataproto(table(rows), pad_token_id=PAD)
    b = dp.batch
    # widths: longest prompt 3, longest response 4
    assert b["prompts"].tolist() == [[11, 12, 13], [PAD, PAD, 31]]  # left-padded
    assert b["responses"].tolist() == [[21, 22, PAD, PAD], [41, 42, 43, 44]]  # right-padded
    assert b["input_ids"].tolist() == [[11, 12, 13, 21, 22, PAD, PAD], [PAD, PAD, 31, 41, 42, 43, 44]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    # verl's convention: positions count real tokens from 0 (cumsum(mask) - 1, clipped at 0), so left
    # padding sits at 0 and right padding repeats the last position
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4]]
    assert b["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert torch.allclose(b["old_log_probs"],
                          torch.tensor([[-0.21, -0.22, 0, 0], [-0.41, -0.42, -0.43, -0.44]]))
    assert b["advantages"].tolist() == [[1.0, 1.0, 0, 0], [-0.5, -0.5, -0.5, -0.5]]
    assert dp.meta_info == {"temperature": 1.0}
    assert list(dp.non_tensor_batch["uid"]) == ["a", "b"]
    assert b["input_ids"].dtype == torch.int64 and b["old_log_probs"].dtype == torch.float32


def test_multi_turn_sample_splits_at_first_generated_token():
    # prompt | gen | tool result | gen | tool | gen : tool tokens sit inside the response, masked out
    row = sample("m", [("ctx", [1, 2]), ("gen", [10, 11]), ("ctx", [50, 51, 52]), ("gen", [12]),
                       ("ctx", [53]), ("gen", [13, 14])], advantage=2.0)
    dp = samples_to_dataproto(table([row]), pad_token_id=PAD, max_prompt_len=4, max_response_len=10)
    b = dp.batch
    assert b["prompts"].tolist() == [[PAD, PAD, 1, 2]]
    assert b["responses"].tolist() == [[10, 11, 50, 51, 52, 12, 53, 13, 14, PAD]]
    assert b["response_mask"].tolist() == [[1, 1, 0, 0, 0, 1, 0, 1, 1, 0]]
    # response_mask selects exactly the loss_mask tokens, and the logprobs/advantages ride along with them
    chosen = b["responses"][b["response_mask"].bool()].tolist()
    assert chosen == [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert torch.allclose(b["old_log_probs"][b["response_mask"].bool()],
                          torch.tensor([-0.10, -0.11, -0.12, -0.13, -0.14]))
    assert (b["old_log_probs"][~b["response_mask"].bool()] == 0).all()
    assert b["advantages"].tolist() == [[2.0 * m for m in [1, 1, 0, 0, 0, 1, 0, 1, 1, 0]]]
    assert b["position_ids"][0].tolist() == [0, 0, 0, 1] + list(range(2, 11)) + [10]


def test_loss_weight_is_folded_into_advantages_only_when_asked():
    rows = [sample("a", [("ctx", [1]), ("gen", [2, 3])], advantage=-1.5, loss_weight=0.25)]
    plain = samples_to_dataproto(table(rows), pad_token_id=PAD)
    folded = samples_to_dataproto(table(rows), pad_token_id=PAD, fold_loss_weight=True)
    assert plain.batch["advantages"].tolist() == [[-1.5, -1.5]]
    assert folded.batch["advantages"].tolist() == [[-0.375, -0.375]]


def with_token_advantages(samples: pa.Table, rows: list[list[float]]) -> pa.Table:
    """``samples`` with on-policy distillation's ``token_advantage`` column (one list per sample)."""
    return samples.append_column("token_advantage", pa.array(rows, pa.list_(pa.float32())))


def test_per_token_advantages_replace_the_samples_and_are_folded_like_it():
    rows = [sample("a", [("ctx", [1, 2]), ("gen", [3, 4]), ("ctx", [5]), ("gen", [6])], advantage=9.0,
                   loss_weight=0.5)]
    samples = with_token_advantages(table(rows), [[math.nan, 7.0, 0.5, -2.0, math.nan, 1.0]])  # off the mask
    plain = samples_to_dataproto(samples, pad_token_id=PAD)
    assert plain.batch["advantages"].tolist() == [[0.5, -2.0, 0.0, 1.0]]
    folded = samples_to_dataproto(samples, pad_token_id=PAD, fold_loss_weight=True)
    assert folded.batch["advantages"].tolist() == [[0.25, -1.0, 0.0, 0.5]]
    bad = with_token_advantages(table(rows), [[0.0, 0.0, math.inf, 0.0, 0.0, 0.0]])
    with pytest.raises(SampleError, match="sample a has a non-finite token_advantage on a generated"):
        samples_to_dataproto(bad, pad_token_id=PAD)
    short = with_token_advantages(table(rows), [[0.0, 1.0]])
    with pytest.raises(SampleError, match="sample a has 6 input_ids but 2 token_advantage"):
        samples_to_dataproto(short, pad_token_id=PAD)


def test_behaviour_logprobs_off_the_mask_are_zeroed():
    row = sample("a", [("ctx", [1]), ("gen", [2]), ("ctx", [3]), ("gen", [4])])
    row["behaviour_logprobs"] = [-9.0, -0.5, -9.0, -0.25]  # junk where the mask is 0
    dp = samples_to_dataproto(table([row]), pad_token_id=PAD)
    assert dp.batch["old_log_probs"].tolist() == [[-0.5, 0.0, -0.25]]


segment = st.tuples(st.sampled_from(["ctx", "gen"]), st.lists(st.integers(1, 500), min_size=1, max_size=6))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(segment, min_size=1, max_size=6), min_size=1, max_size=5))
def test_round_trip_preserves_tokens_mask_and_logprobs(samples_segments):
    rows = []
    for i, segs in enumerate(samples_segments):
        segs = [("ctx", [7])] + list(segs) + [("gen", [9])]  # a prompt first, a generated token somewhere
        rows.append(sample(f"s{i}", segs, advantage=float(i) - 1.5))
    dp = samples_to_dataproto(table(rows), pad_token_id=PAD)
    for i, row in enumerate(rows):
        ids, mask, lps = unpack(dp, i)
        assert ids == row["input_ids"]
        assert mask == row["loss_mask"]
        assert np.allclose(lps, row["behaviour_logprobs"])
    b = dp.batch
    assert int(b["response_mask"].sum()) == sum(sum(r["loss_mask"]) for r in rows)
    assert torch.equal(b["advantages"] != 0, b["response_mask"].bool() & (torch.tensor(
        [r["advantage"] for r in rows])[:, None] != 0))
    # verl's position convention: cumsum(attention_mask) - 1, clipped at 0
    assert torch.equal(b["position_ids"], (b["attention_mask"].cumsum(1) - 1).clamp(min=0))


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.update(loss_mask=[0] * len(r["loss_mask"])), "no generated token"),
    (lambda r: r.update(loss_mask=[1] + r["loss_mask"][1:]), "no prompt"),
    (lambda r: r.update(behaviour_logprobs=r["behaviour_logprobs"][:-1]), "but 3 behaviour_logprobs"),
    (lambda r: r.update(advantage=math.nan), "non-finite"),
])
def test_bad_samples_get_one_sentence_naming_the_sample(mutate, message):
    row = sample("bad-1", [("ctx", [1, 2]), ("gen", [3, 4])])
    mutate(row)
    with pytest.raises(SampleError, match=message) as err:
        samples_to_dataproto(pa.Table.from_pylist([row]), pad_token_id=PAD)
    assert "bad-1" in str(err.value)


def test_over_long_samples_and_missing_columns_are_refused():
    rows = table([sample("long", [("ctx", [1, 2, 3]), ("gen", [4, 5])])])
    with pytest.raises(SampleError, match="'long' has a prompt of 3 tokens, over the prompt"):
        samples_to_dataproto(rows, pad_token_id=PAD, max_prompt_len=2)
    with pytest.raises(SampleError, match="response of 2 tokens"):
        samples_to_dataproto(rows, pad_token_id=PAD, max_response_len=1)
    with pytest.raises(SampleError, match="lack column.*loss_weight"):
        samples_to_dataproto(rows.drop(["loss_weight"]), pad_token_id=PAD)
    with pytest.raises(SampleError, match="empty"):
        samples_to_dataproto(rows.slice(0, 0), pad_token_id=PAD)
    with pytest.raises(SampleError, match="loss_weight 0.0, not > 0"):
        samples_to_dataproto(table([sample("w0", [("ctx", [1]), ("gen", [2])], loss_weight=0.0)]),
                             pad_token_id=PAD, fold_loss_weight=True)


def test_chunked_and_sliced_tables_convert_like_whole_ones():
    rows = [sample(f"s{i}", [("ctx", [1] * (i + 1)), ("gen", [2] * (3 - i))]) for i in range(3)]
    whole = samples_to_dataproto(table(rows), pad_token_id=PAD)
    chunked = pa.concat_tables([table(rows[:1]), table(rows[1:])])
    sliced = table([rows[0]] + rows).slice(1)  # non-zero list offsets
    for other in (chunked, sliced):
        dp = samples_to_dataproto(other, pad_token_id=PAD)
        for key in whole.batch.keys():
            assert torch.equal(whole.batch[key], dp.batch[key]), key


# -- config ----------------------------------------------------------------------------------------


def test_config_maps_onto_verl_actor_config():
    from verl.workers.config import FSDPActorConfig

    cfg = VerlConfig(model_path="/m", ppo_micro_batch_size_per_gpu=2, lr=1e-5, loss=LossConfig(clip_high=0.3))
    actor = cfg.to_verl(mini_batch_size=8)
    assert isinstance(actor, FSDPActorConfig)
    assert actor.loss_agg_mode == "token-sum"  # lgt's "rollout": weights folded into the advantages
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.ppo_mini_batch_size) == (0.2, 0.3, 8)
    assert actor.clip_ratio_c == 1e9  # lgt's dual clip is off unless asked for: verl's bound never bites
    assert actor.optim.lr == 1e-5 and actor.ppo_micro_batch_size_per_gpu == 2
    assert actor.engine.strategy == "fsdp2" and not actor.use_kl_loss
    mean = VerlConfig(model_path="/m", loss=LossConfig(agg="seq-mean-token-mean", kl_coef=0.01, kl_kind="k1",
                                                       dual_clip=3.0)).to_verl()
    assert mean.loss_agg_mode == "seq-mean-token-mean" and mean.use_kl_loss and mean.kl_loss_coef == 0.01
    assert mean.kl_loss_type == "kl" and mean.clip_ratio_c == 3.0


@pytest.mark.parametrize("values, message", [
    ({"loss": LossConfig(kl_coef=0.1)}, "algorithm.kl_coef must be 0 with algorithm.agg rollout"),
    ({"ppo_mini_batch_size": 6, "ppo_micro_batch_size_per_gpu": 4},
     "multiple of backend.ppo_micro_batch_size"),
    ({"lr": 0.0}, "backend.lr must be a finite number > 0"),
    ({"strategy": "megatron"}, "backend.strategy must be one of fsdp, fsdp2"),
    ({"param_dtype": "fp8"}, "backend.param_dtype must be one of"),
    ({"ppo_epochs": 0}, "backend.ppo_epochs must be a positive integer"),
    ({"max_prompt_len": 0}, "backend.max_prompt_len must be a positive integer or null"),
    ({"old_logprobs": "fresh"}, "backend.old_logprobs must be one of behaviour, recompute, not 'fresh'"),
    ({"world_size": 0}, "backend.world_size must be a positive integer"),
    ({"lora": LoraConfig(dropout=0.1)}, "backend.lora.dropout is 0.1 but verl's LoRA has no dropout"),
])
def test_config_errors_are_one_sentence(values, message):
    with pytest.raises(VerlConfigError, match=message) as err:
        VerlConfig(model_path="/m", **values)
    assert "\n" not in str(err.value)


# -- verl's loss under the folding ---------------------------------------------------------------


def test_token_sum_with_folded_weights_equals_rollout_weighted_loss():
    """Σ_i w_i Σ_t ppo(A_i) = verl token-sum of ppo(w_i · A_i), dual-clip branches included."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    g = torch.Generator().manual_seed(0)
    b, t = 6, 9
    logp_old = -torch.rand(b, t, generator=g) * 3
    logp = logp_old + torch.randn(b, t, generator=g)  # ratios well outside the clip range too
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    adv = torch.tensor([2.0, -1.0, 0.5, -3.0, 0.0, 1.0])
    w = torch.tensor([0.1, 0.3, 0.05, 0.2, 0.15, 0.2])
    lgt = VerlConfig(model_path="/m", loss=LossConfig(dual_clip=3.0))  # agg "rollout": verl's token-sum
    cfg = lgt.to_verl(mini_batch_size=b)
    cfg.global_batch_info.clear()
    ref_cfg = lgt.to_verl(mini_batch_size=b)
    ref_cfg.global_batch_info.clear()
    # reference: per-sample token sums of the unweighted loss, weighted afterwards
    per_sample = [compute_policy_loss_vanilla(logp_old[i:i + 1], logp[i:i + 1], adv[i].expand(1, t),
                                              mask[i:i + 1], "token-sum", ref_cfg)[0] for i in range(b)]
    expected = sum(w[i] * per_sample[i] for i in range(b))
    folded, _ = compute_policy_loss_vanilla(logp_old, logp, (adv * w)[:, None].expand(b, t), mask,
                                            cfg.loss_agg_mode, cfg)
    assert torch.allclose(folded, expected, atol=1e-6)
    assert not torch.allclose(folded, sum(per_sample) / b)  # the weights matter


# -- verl's actor on a tiny model ------------------------------------------------------------------


def on_policy_samples(model_dir, n: int = 4, seed: int = 0) -> pa.Table:
    """Samples whose behaviour logprobs are the model's own (as a fresh engine would record them):
    even rows advantage +1, odd rows -1; one multi-turn row with a masked tool segment."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        segs = [("ctx", rng.integers(3, 300, 4 + i).tolist()), ("gen", rng.integers(3, 300, 5).tolist())]
        if i == 1:
            segs += [("ctx", rng.integers(3, 300, 3).tolist()), ("gen", rng.integers(3, 300, 2).tolist())]
        rows.append(sample(f"s{i}", segs, advantage=1.0 if i % 2 == 0 else -1.0, loss_weight=1 / n))
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            row["behaviour_logprobs"] = [0.0] + [float(x) * m for x, m in zip(lp, row["loss_mask"][1:])]
    return table(rows)


def run_actor(model_dir, old_logprobs: str = "behaviour"):
    """3 updates on on-policy samples; with "recompute" the recorded logprobs are made stale by 0.3 nats."""
    samples = on_policy_samples(model_dir)
    stale = 0.3 if old_logprobs == "recompute" else 0.0
    if stale:
        rows = samples.to_pylist()
        for row in rows:
            lps, mask = row["behaviour_logprobs"], row["loss_mask"]
            row["behaviour_logprobs"] = [lp - stale * m for lp, m in zip(lps, mask)]
        samples = table(rows)
    cfg = VerlConfig(model_path=str(model_dir), lr=2e-4, param_dtype="fp32", ppo_micro_batch_size_per_gpu=2,
                     old_logprobs=old_logprobs)
    backend = VerlInProcessActor(cfg)
    try:
        before = backend.logprobs(samples)
        dp = backend.to_dataproto(samples)
        mask = dp.batch["response_mask"].bool()
        # verl's forward matches the recorded (transformers) logprobs: the alignment is right
        assert torch.allclose(before[mask], dp.batch["old_log_probs"][mask] + stale, atol=1e-4)
        history = [backend.train_step(samples) for _ in range(3)]
        after = backend.logprobs(samples)
        weights = {name: t.float().cpu().clone() for name, t in backend.named_weights()}
    finally:
        backend.close()
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert set(weights) <= set(initial) and "model.embed_tokens.weight" in weights
    assert all(weights[k].shape == initial[k].shape for k in weights)
    up = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(weights[up], initial[up])  # the update reached the weights verl would sync
    first = history[0]
    advantage = torch.tensor(samples.column("advantage").to_pylist())[:, None]  # from the store, not verl's
    assert first["batch/samples"] == 4 and first["batch/tokens"] == int(mask.sum())
    assert abs(first["actor/ppo_kl"]) < 1e-4  # on-policy (or recomputed): ratio 1 at the first step
    # at ratio 1 the rollout-weighted loss is -Σ_i w_i A_i (tokens_i) · IS weight: checks that verl ran
    # token-sum over the folded advantages and multiplied the IS weights in
    tokens = torch.tensor([sum(m) for m in samples.column("loss_mask").to_pylist()], dtype=torch.float64)
    weights = torch.tensor(samples.column("loss_weight").to_pylist(), dtype=torch.float64)
    expected = -math.exp(stale) * float((weights * advantage[:, 0].double() * tokens).sum())
    assert first["loss/pg"] == pytest.approx(expected, rel=1e-4) and expected != 0
    if stale:  # truncated IS: min(exp(old - behaviour), 2) = exp(0.3) on every token
        assert first["actor/behaviour_kl"] == pytest.approx(stale, abs=1e-4)
        assert first["actor/is_weight_mean"] == pytest.approx(math.exp(stale), abs=1e-3)
    else:
        assert "actor/is_weight_mean" not in first
    assert all(math.isfinite(v) for m in history for v in m.values())
    assert first["actor/grad_norm"] > 0
    delta = (after - before)
    pos = mask & (advantage > 0)
    neg = mask & (advantage < 0)
    assert delta[pos].mean() > 0 > delta[neg].mean(), (delta[pos].mean(), delta[neg].mean())
    assert history[-1]["loss/pg"] < history[0]["loss/pg"]


@pytest.mark.slow
@pytest.mark.parametrize("old_logprobs", ["behaviour", "recompute"])
def test_actor_update_on_cpu_moves_logprobs_with_advantages(tiny_model_dir, old_logprobs):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the gpu test covers the actor")
    run_actor(tiny_model_dir, old_logprobs)


@pytest.mark.gpu
@pytest.mark.parametrize("old_logprobs", ["behaviour", "recompute"])
def test_actor_update_on_cuda_moves_logprobs_with_advantages(tiny_model_dir, old_logprobs):
    run_actor(tiny_model_dir, old_logprobs)


@pytest.mark.slow
def test_missing_behaviour_logprobs_are_recomputed_before_the_update(tiny_model_dir):
    # A call recorded without logprobs reaches verl as NaN behaviour logprobs; they become the policy's
    # own from a forward pass before the update, so on-policy samples train exactly as if recorded.
    if torch.cuda.is_available():
        pytest.skip("CPU check")
    recorded = on_policy_samples(tiny_model_dir)
    rows = recorded.to_pylist()
    rows[0]["behaviour_logprobs"] = [math.nan if m else 0.0 for m in rows[0]["loss_mask"]]
    missing = table(rows)
    out = {}
    for name, samples in (("recorded", recorded), ("missing", missing)):
        backend = VerlInProcessActor(VerlConfig(model_path=str(tiny_model_dir), lr=2e-4, param_dtype="fp32",
                                         ppo_micro_batch_size_per_gpu=2))
        try:
            metrics = backend.train_step(samples)
            out[name] = (metrics, {n: t.float().cpu().clone() for n, t in backend.named_weights()})
        finally:
            backend.close()
    (m_rec, w_rec), (m_mis, w_mis) = out["recorded"], out["missing"]
    assert m_rec["actor/behaviour_recomputed_frac"] == 0.0
    assert m_mis["actor/behaviour_recomputed_frac"] == pytest.approx(5 / sum(map(sum, recorded.column(
        "loss_mask").to_pylist())))
    assert m_mis["loss/pg"] == pytest.approx(m_rec["loss/pg"], rel=1e-4) and math.isfinite(m_mis["loss/pg"])
    assert m_mis["actor/grad_norm"] == pytest.approx(m_rec["actor/grad_norm"], rel=1e-3)
    # (verl's forward and transformers' differ by ~1e-5, and Adam's first step is lr * sign(grad), so a
    # weight whose gradient is ~0 may step either way: at most 2 * lr apart)
    for n, w in w_rec.items():
        assert torch.allclose(w_mis[n], w, atol=2 * 2e-4), n


@pytest.mark.slow
def test_the_verl_backend_checkpoints_as_an_hf_model_and_resumes_exactly(tiny_model_dir, tmp_path):
    # lgt-train's verl backend (VerlBackend): a checkpoint is a model directory vLLM can serve, plus
    # verl's own state; --resume rebuilds the actor on it and continues as if it had not stopped.
    if torch.cuda.is_available():
        pytest.skip("CPU check")
    from transformers import AutoModelForCausalLM

    from lgt.trainer.backends.base import entry
    from lgt.trainer.backends.checkpoints import latest_checkpoint

    trainer_cls = entry("verl").load_class()
    samples = on_policy_samples(tiny_model_dir)
    cfg = VerlConfig(lr=2e-4, param_dtype="fp32", ppo_micro_batch_size_per_gpu=2)
    trainer = trainer_cls.load(tiny_model_dir, cfg)
    try:
        trainer.train_step(samples)
        ckpt = trainer.save_checkpoint(tmp_path / "checkpoints", {"version": 1, "trained_groups": ["g0"]})
        weights = {n: t.float().cpu().clone() for n, t in trainer.named_weights()}
        continued = trainer.train_step(samples)
    finally:
        trainer.close()
    assert ckpt == latest_checkpoint(tmp_path / "checkpoints") and ckpt.name == "step-00000001"
    assert {"config.json", "model.safetensors", "tokenizer.json", "DONE", "verl"} <= \
        {p.name for p in ckpt.iterdir()}
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict()  # what vLLM would serve
    for name, w in weights.items():
        assert torch.equal(hf[name], w), name
    resumed, extra = trainer_cls.resume(ckpt, cfg)
    try:
        assert extra == {"version": 1, "trained_groups": ["g0"]} and resumed.step == 1
        again = resumed.train_step(samples)
    finally:
        resumed.close()
    assert again["loss/pg"] == continued["loss/pg"]  # the same second step, bit for bit
    assert again["actor/grad_norm"] == continued["actor/grad_norm"]


@pytest.mark.slow
def test_on_policy_distillation_trains_each_token_by_its_own_advantage(tiny_model_dir):
    # OPD on verl (the sampled log-ratio): each generated token carries its own advantage. Here every
    # sample's advantage is +1 and every other generated token's is -1, so a backend that used the
    # sample's advantage would raise those tokens too. sample_logprobs (what OPD takes where a call
    # recorded no logprobs) is aligned with input_ids: the recorded (transformers) logprobs.
    if torch.cuda.is_available():
        pytest.skip("CPU check")
    from lgt.trainer.backends.base import entry

    rows = on_policy_samples(tiny_model_dir).to_pylist()
    for row in rows:
        row["advantage"] = 1.0
    recorded = table(rows)
    signs = []
    for mask in recorded.column("loss_mask").to_pylist():
        k = 0
        row = []
        for m in mask:
            row.append((1.0 if k % 2 == 0 else -1.0) if m else 0.0)
            k += m
        signs.append(row)
    samples = with_token_advantages(recorded, signs)
    trainer = entry("verl").load_class().load(tiny_model_dir, VerlConfig(lr=2e-4, param_dtype="fp32",
                                                                         ppo_micro_batch_size_per_gpu=2))
    try:
        before = trainer.sample_logprobs(samples)
        for _ in range(3):
            trainer.train_step(samples)
        after = trainer.sample_logprobs(samples)
    finally:
        trainer.close()
    up = down = 0.0
    n_up = n_down = 0
    for b, a, mask, blp, sign in zip(before, after, recorded.column("loss_mask").to_pylist(),
                                     recorded.column("behaviour_logprobs").to_pylist(), signs):
        m = np.asarray(mask) != 0
        assert b.shape == a.shape == m.shape
        assert np.allclose(b[m], np.asarray(blp)[m], atol=1e-4)
        d, s = (a - b)[m], np.asarray(sign)[m]
        up, down = up + d[s > 0].sum(), down + d[s < 0].sum()
        n_up, n_down = n_up + (s > 0).sum(), n_down + (s < 0).sum()
    assert n_up and n_down
    assert up / n_up > 0 > down / n_down, (up / n_up, down / n_down)


def test_verl_lora_trains_its_adapter_gives_merged_weights_and_resumes_exactly(tiny_model_dir, tmp_path):
    # backend.lora on verl: verl's own LoRA (PEFT in its FSDP engine) on q_proj and v_proj; the weights
    # for the engine are merged (only the targeted projections move), the checkpoint is a servable
    # model of them plus verl's state, and --resume continues exactly
    if torch.cuda.is_available():
        pytest.skip("CPU check")
    from transformers import AutoModelForCausalLM

    from lgt.trainer.backends.base import BackendError, entry

    trainer_cls = entry("verl").load_class()
    samples = on_policy_samples(tiny_model_dir)
    cfg = VerlConfig(lr=1e-2, param_dtype="fp32", ppo_micro_batch_size_per_gpu=2,
                     lora=LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj")))
    trainer = trainer_cls.load(tiny_model_dir, cfg)
    try:
        assert trainer.lora == cfg.lora
        with pytest.raises(BackendError, match="keeps its LoRA adapter inside its FSDP engine"):
            trainer.save_adapter(tmp_path / "adapter")
        before = {n: t.float().cpu().clone() for n, t in trainer.named_weights()}
        trainer.train_step(samples)
        trainer.train_step(samples)  # B starts at 0: the second step moves A too
        ckpt = trainer.save_checkpoint(tmp_path / "checkpoints", {"version": 2})
        weights = {n: t.float().cpu().clone() for n, t in trainer.named_weights()}
        continued = trainer.train_step(samples)
    finally:
        trainer.close()
    for name, w in weights.items():
        targeted = name.endswith(("q_proj.weight", "v_proj.weight"))
        assert (not torch.equal(w, before[name])) == targeted, name
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict()
    for name, w in weights.items():
        assert torch.equal(hf[name], w), name
    resumed, extra = trainer_cls.resume(ckpt, cfg)
    try:
        assert extra == {"version": 2} and resumed.step == 2
        again = resumed.train_step(samples)
    finally:
        resumed.close()
    assert again["loss/pg"] == continued["loss/pg"]
    assert again["actor/grad_norm"] == continued["actor/grad_norm"]
