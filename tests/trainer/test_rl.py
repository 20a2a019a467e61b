"""Unit tests of lgt.trainer.rl.loss on tiny hand-computed tensors, plus Hypothesis properties."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lgt.trainer.rl import loss as rl

E = math.e
LN2 = math.log(2.0)
SETTINGS = settings(max_examples=60, deadline=None)


def t(*rows: object, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=dtype)


def close(a: torch.Tensor | float, b: object, atol: float = 1e-6) -> bool:
    a = torch.as_tensor(a, dtype=torch.float64)
    return torch.allclose(a, torch.as_tensor(b, dtype=torch.float64), atol=atol, rtol=1e-5)


# --- masked_sum / masked_mean ---------------------------------------------------------------------

def test_masked_sum_and_mean_ignore_masked_values_even_nan() -> None:
    x = t([1.0, 2.0, 3.0], [4.0, 5.0, math.nan])
    mask = t([1, 0, 1], [1, 1, 0])
    # all: 1 + 3 + 4 + 5 = 13 over 4 tokens
    assert close(rl.masked_sum(x, mask), 13.0)
    assert close(rl.masked_mean(x, mask), 13.0 / 4)
    # per row: [1 + 3, 4 + 5] = [4, 9]; means [4 / 2, 9 / 2]
    assert close(rl.masked_sum(x, mask, dim=-1), [4.0, 9.0])
    assert close(rl.masked_mean(x, mask, dim=-1), [2.0, 4.5])


def test_masked_mean_of_empty_mask_is_zero_and_bf16_is_upcast() -> None:
    x = t([1.0, 2.0], [3.0, 4.0]).bfloat16()
    mask = t([0, 0], [1, 1])
    # row 0 has no tokens -> 0; row 1 -> (3 + 4) / 2
    out = rl.masked_mean(x, mask, dim=-1)
    assert out.dtype == torch.float32
    assert close(out, [0.0, 3.5])
    assert close(rl.masked_mean(x, torch.zeros_like(mask)), 0.0)


# --- token_logprobs -------------------------------------------------------------------------------

def reference_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    picked = lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def test_token_logprobs_hand_computed() -> None:
    # V = 2, logits [0, ln 3] at every position -> p = [1/4, 3/4]
    logits = torch.tensor([0.0, math.log(3.0)]).repeat(1, 4, 1)
    ids = torch.tensor([[1, 1, 0, 1]])
    # position 0 has no prediction -> 0; then tokens 1, 0, 1 -> log 3/4, log 1/4, log 3/4
    expected = [[0.0, math.log(0.75), math.log(0.25), math.log(0.75)]]
    for chunk in (None, 1, 2, 10):
        out = rl.token_logprobs(logits, ids, chunk_size=chunk)
        assert out.dtype == torch.float32 and out.shape == (1, 4)
        assert close(out, expected)


def test_token_logprobs_bf16_logits_give_float32() -> None:
    # uniform logits over V = 4 -> log 1/4 everywhere after position 0
    logits = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    out = rl.token_logprobs(logits, torch.tensor([[0, 1, 2], [3, 3, 3]]))
    assert out.dtype == torch.float32
    assert close(out, [[0.0, -math.log(4), -math.log(4)]] * 2)


def test_token_logprobs_gradient_matches_autograd_reference_and_gradcheck() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 5, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 5, (2, 6))
    assert torch.autograd.gradcheck(lambda x: rl.token_logprobs(x, ids, chunk_size=4), (logits,))
    weights = torch.randn(2, 6, dtype=torch.float64)
    (ours,) = torch.autograd.grad((rl.token_logprobs(logits, ids, chunk_size=2) * weights).sum(), logits)
    (ref,) = torch.autograd.grad((reference_logprobs(logits, ids) * weights).sum(), logits)
    assert torch.allclose(ours, ref, atol=1e-12)
    # the last position predicts no input token: its logits get no gradient
    assert torch.count_nonzero(ours[:, -1]) == 0


def test_token_logprobs_keeps_no_float32_copy_for_backward() -> None:
    # bf16 logits (B, T, V): everything saved for backward must fit in the logits + ids themselves;
    # a log_softmax of .float() logits would save a (B, T, V) float32 tensor (2x the logits' bytes).
    logits = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 64, (2, 16))
    saved: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x.numel() * x.element_size())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        rl.token_logprobs(logits, ids, chunk_size=4).sum().backward()
    assert saved  # the hook saw what was saved
    assert sum(saved) <= logits.numel() * logits.element_size() + ids.numel() * 8
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16

    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        reference_logprobs(logits, ids).sum()
    assert sum(saved) >= logits.numel() * 4  # the reference does keep the float32 copy


def test_token_logprobs_single_position_and_bad_shapes() -> None:
    logits = torch.randn(3, 1, 4, requires_grad=True)
    out = rl.token_logprobs(logits, torch.zeros(3, 1, dtype=torch.long))
    assert close(out, [[0.0]] * 3)
    out.sum().backward()  # still connected to the graph
    with pytest.raises(ValueError, match="logits must be"):
        rl.token_logprobs(torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        rl.token_logprobs(torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        rl.token_logprobs(torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), chunk_size=0)


@SETTINGS
@given(b=st.integers(1, 3), t_=st.integers(1, 9), v=st.integers(1, 12),
       chunk=st.one_of(st.none(), st.integers(1, 9)),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_property_token_logprobs_equals_log_softmax_gather(b: int, t_: int, v: int, chunk: int | None,
                                                           dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, t_, v, generator=g) * 4).to(dtype)
    ids = torch.randint(0, v, (b, t_), generator=g)
    out = rl.token_logprobs(logits, ids, chunk_size=chunk)
    assert out.dtype == torch.float32
    assert torch.allclose(out, reference_logprobs(logits, ids), atol=1e-5)


@SETTINGS
@given(b=st.integers(1, 3), t_=st.integers(1, 9), v=st.integers(1, 12),
       chunk=st.one_of(st.none(), st.integers(1, 9)),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       sliced=st.booleans(), seed=st.integers(0, 2**16))
def test_property_token_logprobs_gradient_equals_log_softmax_gather(
        b: int, t_: int, v: int, chunk: int | None, dtype: torch.dtype, sliced: bool, seed: int) -> None:
    # sliced: logits[:, :-1] of a longer tensor cannot be viewed as (B*T, V) rows
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(b, t_ + sliced, v, generator=g) * 4).to(dtype).requires_grad_()
    logits = base[:, :t_]
    ids = torch.randint(0, v, (b, t_), generator=g)
    weights = torch.randn(b, t_, generator=g)
    (ours,) = torch.autograd.grad((rl.token_logprobs(logits, ids, chunk_size=chunk) * weights).sum(), base)
    (ref,) = torch.autograd.grad((reference_logprobs(logits, ids) * weights).sum(), base)
    assert ours.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # low precision: the same float32 value, rounded once
    assert torch.allclose(ours.float(), ref.float(), atol=tol, rtol=tol)


def test_token_logprobs_last_position_never_reaches_output_or_gradient() -> None:
    # the logits of the last position predict no input token: even inf / NaN there changes nothing
    torch.manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        clean = torch.randn(2, 5, 7).to(dtype)
        logits = clean.clone()
        logits[0, -1, 3], logits[1, -1] = math.inf, math.nan
        logits.requires_grad_()
        ids = torch.randint(0, 7, (2, 5))
        out = rl.token_logprobs(logits, ids, chunk_size=3)
        assert torch.allclose(out, reference_logprobs(clean, ids), atol=1e-5)
        out.sum().backward()
        assert torch.isfinite(logits.grad).all()
        assert torch.count_nonzero(logits.grad[:, -1]) == 0


def test_token_logprobs_empty_batch_or_sequence() -> None:
    for shape in ((2, 0, 5), (0, 3, 5)):
        logits = torch.randn(*shape, requires_grad=True)
        out = rl.token_logprobs(logits, torch.zeros(shape[:2], dtype=torch.long))
        assert out.shape == shape[:2] and out.dtype == torch.float32
        out.sum().backward()
        assert logits.grad is not None and logits.grad.shape == shape


# --- importance_weights ---------------------------------------------------------------------------

def test_importance_weights_each_mode_hand_computed() -> None:
    old = t([[1.0, 0.0, -1.0, 5.0]])
    behaviour = t([[0.0, 0.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    # ratio will be [e, 1, 1/e, (masked)]; masked positions get weight 1
    assert close(rl.importance_weights(old, behaviour, mask, mode="none"), [[1, 1, 1, 1]])
    # truncate at 2: [min(e, 2), 1, 1/e]
    assert close(rl.importance_weights(old, behaviour, mask, mode="truncate", cap=2.0), [[2, 1, 1 / E, 1]])
    # mask with cap 2 keeps ratios in [0.5, 2]: e > 2 and 1/e < 0.5 are dropped
    assert close(rl.importance_weights(old, behaviour, mask, mode="mask", cap=2.0), [[0, 1, 0, 1]])
    # cap 3 keeps [1/3, 3]: all three kept
    assert close(rl.importance_weights(old, behaviour, mask, mode="mask", cap=3.0), [[1, 1, 1, 1]])
    assert rl.IS_MODES.keys() == {"none", "truncate", "mask"}


def test_importance_weights_bad_mode_or_cap() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"'tis'.*none, truncate, mask"):
        rl.importance_weights(x, x, x, mode="tis")
    with pytest.raises(ValueError, match="cap"):
        rl.importance_weights(x, x, x, cap=0.5)
    with pytest.raises(ValueError, match="same shape"):
        rl.importance_weights(x, torch.zeros(1, 3), x)


logprob_lists = st.lists(st.floats(-30.0, 0.0, allow_nan=False), min_size=1, max_size=12)


@SETTINGS
@given(old=logprob_lists, behaviour=logprob_lists, cap=st.floats(1.0, 10.0),
       mode=st.sampled_from(sorted(rl.IS_MODES)))
def test_property_importance_weights_capped_and_detached(old: list[float], behaviour: list[float], cap: float,
                                                         mode: str) -> None:
    n = min(len(old), len(behaviour))
    o = torch.tensor([old[:n]], requires_grad=True)
    bh = torch.tensor([behaviour[:n]], requires_grad=True)
    w = rl.importance_weights(o, bh, torch.ones(1, n), mode=mode, cap=cap)
    assert not w.requires_grad and w.grad_fn is None
    assert bool((w >= 0).all()) and bool((w <= cap + 1e-6).all())
    if mode == "mask":
        assert set(w.flatten().tolist()) <= {0.0, 1.0}


# --- ppo_clip_loss --------------------------------------------------------------------------------

def test_ppo_clip_loss_positive_advantage() -> None:
    old = torch.zeros(1, 3)
    logp = t([[LN2, 0.0, -LN2]])
    mask = torch.ones(1, 3)
    # ratio will be [2, 1, 0.5]; clip to [0.8, 1.28] -> [1.28, 1, 0.8]
    # A = 1: max(-ratio, -clipped) = [max(-2, -1.28), -1, max(-0.5, -0.8)] = [-1.28, -1, -0.5]
    loss, stats = rl.ppo_clip_loss(logp, old, t([1.0]), mask)
    assert close(loss, [[-1.28, -1.0, -0.5]])
    assert close(stats["clipfrac"], 1 / 3)  # only token 0 took the clipped term
    assert close(stats["ratio_mean"], 3.5 / 3)
    # k3: r - 1 - log r = [1 - ln 2, 0, -0.5 + ln 2] -> mean 0.5 / 3
    assert close(stats["approx_kl"], 0.5 / 3)


def test_ppo_clip_loss_negative_advantage_and_dual_clip() -> None:
    old = torch.zeros(1, 4)
    logp = t([[LN2, 0.0, -LN2, math.log(4.0)]])
    mask = t([[1, 1, 1, 0]])
    # ratio [2, 1, 0.5, 4(masked)], A = -1: max(ratio, clipped) = [max(2, 1.28), 1, max(0.5, 0.8), -]
    loss, stats = rl.ppo_clip_loss(logp, old, t([[-1.0, -1.0, -1.0, -1.0]]), mask)
    assert close(loss, [[2.0, 1.0, 0.8, 0.0]])  # masked token -> 0
    assert close(stats["clipfrac"], 1 / 3)
    # dual clip c = 1.5 caps the negative-advantage loss at -A * c = 1.5: 2 -> 1.5
    loss, stats = rl.ppo_clip_loss(logp, old, t([[-1.0, -1.0, -1.0, -1.0]]), mask, dual_clip=1.5)
    assert close(loss, [[1.5, 1.0, 0.8, 0.0]])
    assert close(stats["dual_clipfrac"], 1 / 3)
    # asymmetric: clip_high 1.0 lets a positive-advantage ratio grow to 2 unclipped: -A * 2 = -2
    loss, _ = rl.ppo_clip_loss(logp, old, t([1.0]), mask, clip_low=0.2, clip_high=1.0)
    assert close(loss[0, 0], -2.0)


def test_ppo_clip_loss_bad_clip() -> None:
    x = torch.zeros(1, 2)
    for kwargs, word in (({"clip_low": 1.0}, "clip_low"), ({"clip_high": -0.1}, "clip_high"),
                         ({"dual_clip": 1.0}, "dual_clip")):
        with pytest.raises(ValueError, match=word):
            rl.ppo_clip_loss(x, x, torch.zeros(1), x, **kwargs)
    with pytest.raises(ValueError, match="advantages"):
        rl.ppo_clip_loss(x, x, torch.zeros(3), x)


# --- kl_penalty -----------------------------------------------------------------------------------

def test_kl_penalty_each_kind() -> None:
    ref = torch.zeros(1, 3)
    logp = t([[LN2, 0.0, -LN2]])
    # log ratio logp - ref = [ln 2, 0, -ln 2]
    assert close(rl.kl_penalty(logp, ref, "k1"), [[LN2, 0.0, -LN2]])
    assert close(rl.kl_penalty(logp, ref, "k2"), [[LN2**2 / 2, 0.0, LN2**2 / 2]])
    # k3 with d = ref - logp = [-ln 2, 0, ln 2]: e^d - d - 1 = [0.5 + ln 2 - 1, 0, 2 - ln 2 - 1]
    assert close(rl.kl_penalty(logp, ref, "k3"), [[LN2 - 0.5, 0.0, 1 - LN2]])
    assert close(rl.kl_penalty(logp, ref), rl.kl_penalty(logp, ref, "k3"))  # k3 is the default
    # an extreme token: d = 30 -> clamped to 20, e^20 - 21 -> value clamped to 10
    assert close(rl.kl_penalty(t([[-30.0]]), t([[0.0]]), "k3"), [[10.0]])
    with pytest.raises(ValueError, match=r"'k4'.*k1, k2, k3"):
        rl.kl_penalty(logp, ref, "k4")


# --- aggregate_loss -------------------------------------------------------------------------------

LOSS = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
MASK = t([1, 1, 0], [1, 0, 0])


def test_aggregate_loss_each_mode_hand_computed() -> None:
    # token-mean: (1 + 2 + 4) / 3 tokens
    assert close(rl.aggregate_loss(LOSS, MASK, "token-mean"), 7 / 3)
    assert close(rl.aggregate_loss(LOSS, MASK, "token-mean", num_tokens=7), 1.0)
    # seq-mean-token-mean: ((1 + 2) / 2 + 4 / 1) / 2 samples
    assert close(rl.aggregate_loss(LOSS, MASK, "seq-mean-token-mean"), 2.75)
    assert close(rl.aggregate_loss(LOSS, MASK, "seq-mean-token-mean", num_samples=4), 5.5 / 4)
    # seq-mean-token-sum: ((1 + 2) + 4) / 2 samples
    assert close(rl.aggregate_loss(LOSS, MASK, "seq-mean-token-sum"), 3.5)
    # rollout: 0.1 * (1 + 2) + 0.5 * 4
    assert close(rl.aggregate_loss(LOSS, MASK, "rollout", sample_weights=t([0.1, 0.5])), 2.3)
    assert rl.AGG_MODES.keys() == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "rollout"}


def test_aggregate_loss_empty_rows_and_empty_mask() -> None:
    mask = t([1, 1, 0], [0, 0, 0])
    # a row without tokens is not a sample: (1 + 2) / 2 / 1 sample
    assert close(rl.aggregate_loss(LOSS, mask, "seq-mean-token-mean"), 1.5)
    assert close(rl.aggregate_loss(LOSS, mask, "seq-mean-token-sum"), 3.0)
    per_token = LOSS.clone().requires_grad_()
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        out = rl.aggregate_loss(per_token, torch.zeros(2, 3), mode)
        assert close(out, 0.0)
        out.backward()  # connected to the graph, zero gradient
    assert torch.count_nonzero(per_token.grad) == 0


def test_aggregate_loss_bad_input() -> None:
    with pytest.raises(ValueError, match=r"'mean'.*token-mean, seq-mean-token-mean"):
        rl.aggregate_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="sample_weights"):
        rl.aggregate_loss(LOSS, MASK, "rollout")
    with pytest.raises(ValueError, match="sample_weights"):
        rl.aggregate_loss(LOSS, MASK, "rollout", sample_weights=torch.ones(3))
    with pytest.raises(ValueError, match="num_tokens"):
        rl.aggregate_loss(LOSS, MASK, "token-mean", num_tokens=-1)
    with pytest.raises(ValueError, match="num_samples"):
        rl.aggregate_loss(LOSS, MASK, "seq-mean-token-sum", num_samples=math.nan)
    with pytest.raises(ValueError, match="same shape"):
        rl.aggregate_loss(LOSS, MASK[:, :2], "token-mean")


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    b = draw(st.integers(1, 6))
    t_ = draw(st.integers(1, 5))
    values = draw(st.lists(st.floats(-10, 10, allow_nan=False), min_size=b * t_, max_size=b * t_))
    bits = draw(st.lists(st.integers(0, 1), min_size=b * t_, max_size=b * t_))
    weights = draw(st.lists(st.floats(0.0, 1.0), min_size=b, max_size=b))
    cuts = sorted(draw(st.sets(st.integers(1, b - 1), max_size=b - 1))) if b > 1 else []
    return (torch.tensor(values).view(b, t_), torch.tensor(bits, dtype=torch.float32).view(b, t_),
            torch.tensor(weights), cuts)


@SETTINGS
@given(batch=batches(), mode=st.sampled_from(sorted(rl.AGG_MODES)))
def test_property_micro_batches_sum_to_the_batch_loss(batch: tuple, mode: str) -> None:
    per_token, mask, weights, cuts = batch
    num_tokens = float(mask.sum())
    num_samples = float((mask.sum(-1) > 0).sum())
    whole = rl.aggregate_loss(per_token, mask, mode, sample_weights=weights, num_tokens=num_tokens,
                              num_samples=num_samples)
    assert close(whole, rl.aggregate_loss(per_token, mask, mode, sample_weights=weights), atol=1e-5)
    bounds = [0, *cuts, per_token.shape[0]]
    parts = [rl.aggregate_loss(per_token[a:b], mask[a:b], mode, sample_weights=weights[a:b],
                               num_tokens=num_tokens, num_samples=num_samples)
             for a, b in zip(bounds, bounds[1:])]
    assert close(sum(parts), whole, atol=1e-4)


@st.composite
def rollouts(draw: st.DrawFn) -> tuple[list[list[float]], list[list[int]]]:
    """Per rollout: its generated tokens' losses, and for each token which sample it went to."""
    losses = draw(st.lists(st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=6),
                           min_size=1, max_size=4))
    splits = [draw(st.lists(st.integers(0, 2), min_size=len(l), max_size=len(l))) for l in losses]
    return losses, splits


def rollout_rows(losses: list[list[float]], splits: list[list[int]] | None, prompt: int = 2,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples as the store builds them: a prompt (unmasked) then the rollout's tokens, masked only
    in the sample they were assigned to; loss_weight = 1 / (R * masked tokens of the rollout)."""
    r = len(losses)
    width = prompt + max(len(l) for l in losses)
    rows, masks, weights = [], [], []
    for i, ls in enumerate(losses):
        owner = splits[i] if splits is not None else [0] * len(ls)
        for k in sorted(set(owner)):
            rows.append([7.0] * prompt + ls + [99.0] * (width - prompt - len(ls)))
            masks.append([0] * prompt + [int(o == k) for o in owner] + [0] * (width - prompt - len(ls)))
            weights.append(1.0 / (r * len(ls)))
    return torch.tensor(rows), torch.tensor(masks, dtype=torch.float32), torch.tensor(weights)


@SETTINGS
@given(data=rollouts())
def test_property_rollout_aggregation_counts_each_rollout_once(data: tuple) -> None:
    losses, splits = data
    whole = rl.aggregate_loss(*rollout_rows(losses, None)[:2], "rollout",
                              sample_weights=rollout_rows(losses, None)[2])
    per_token, mask, weights = rollout_rows(losses, splits)
    split = rl.aggregate_loss(per_token, mask, "rollout", sample_weights=weights)
    # 1/R * sum over rollouts of the rollout's mean token loss, however it was split into samples
    expected = sum(sum(l) / len(l) for l in losses) / len(losses)
    assert close(whole, expected, atol=1e-5) and close(split, expected, atol=1e-5)
    # with one sample per rollout it is seq-mean-token-mean
    unsplit_t, unsplit_m, _ = rollout_rows(losses, None)
    assert close(rl.aggregate_loss(unsplit_t, unsplit_m, "seq-mean-token-mean"), expected, atol=1e-5)


# --- LossConfig / policy_loss ---------------------------------------------------------------------

def test_loss_config_defaults_and_validation() -> None:
    cfg = rl.LossConfig()
    assert (cfg.clip_low, cfg.clip_high, cfg.is_mode, cfg.is_cap, cfg.kl_coef, cfg.kl_kind, cfg.agg) == (
        0.2, 0.28, "truncate", 2.0, 0.0, "k3", "rollout")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.agg = "token-mean"  # type: ignore[misc]
    bad = [({"agg": "sum"}, r"loss aggregation 'sum'; choose one of: token-mean"),
           ({"is_mode": "clip"}, r"importance-sampling mode 'clip'; choose one of: none, truncate, mask"),
           ({"kl_kind": "k9"}, r"KL estimator 'k9'; choose one of: k1, k2, k3"),
           ({"is_cap": 0.9}, "cap must be a finite number >= 1"),
           ({"kl_coef": -1.0}, "kl_coef"), ({"clip_low": -0.1}, "clip_low"),
           ({"clip_high": math.inf}, "clip_high"), ({"dual_clip": 0.5}, "dual_clip")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            rl.LossConfig(**kwargs)


def tiny_batch() -> dict[str, torch.Tensor]:
    return {
        "loss_mask": t([0, 1, 1], [0, 1, 0]),
        "advantages": t([1.0, -2.0]),
        "behaviour_logprobs": t([0.0, -1.0, -2.0], [0.0, -1.0, 0.0]),
        "loss_weight": t([0.25, 0.5]),
    }


def test_policy_loss_reinforce_with_rollout_weights() -> None:
    batch = tiny_batch()
    logp = batch["behaviour_logprobs"].clone().requires_grad_()  # old = current = behaviour
    loss, metrics = rl.policy_loss(logp, batch, rl.LossConfig())
    # ratio 1, IS weight 1: per-token loss -A -> 0.25 * (-1 - 1) + 0.5 * (+2) = 0.5
    assert close(loss, 0.5)
    assert close(metrics["loss/pg"], 0.5) and close(metrics["loss/total"], 0.5)
    assert metrics["actor/clipfrac"] == 0.0 and close(metrics["actor/ratio_mean"], 1.0)
    assert close(metrics["actor/is_weight_mean"], 1.0) and metrics["actor/is_clipped_frac"] == 0.0
    assert close(metrics["actor/behaviour_kl"], 0.0) and "loss/kl" not in metrics
    loss.backward()
    # d loss / d logp = -A * w on the masked tokens: [-, -0.25, -0.25], [-, +1, -]
    assert close(logp.grad, [[0.0, -0.25, -0.25], [0.0, 1.0, 0.0]])


def test_policy_loss_truncated_is_and_old_logprobs() -> None:
    batch = tiny_batch()
    # the engine was less sure of token (0, 1): old - behaviour = 1 -> ratio e, truncated to 2
    batch["old_logprobs"] = batch["behaviour_logprobs"] + t([0.0, 1.0, 0.0], [0.0, 0.0, 0.0])
    logp = batch["old_logprobs"].clone().requires_grad_()
    loss, metrics = rl.policy_loss(logp, batch, rl.LossConfig())
    # per token -A * is_w: row 0 [-, -2, -1], row 1 [-, +2, -] -> 0.25 * -3 + 0.5 * 2 = 0.25
    assert close(loss, 0.25)
    # IS weights [2, 1, 1] over the 3 masked tokens; one of them truncated; old - behaviour mean 1/3
    assert close(metrics["actor/is_weight_mean"], 4 / 3)
    assert close(metrics["actor/is_clipped_frac"], 1 / 3)
    assert close(metrics["actor/behaviour_kl"], 1 / 3)
    # "mask" drops the token instead: row 0 [-, 0, -1] -> 0.25 * -1 + 0.5 * 2 = 0.75
    loss, metrics = rl.policy_loss(logp, batch, rl.LossConfig(is_mode="mask"))
    assert close(loss, 0.75) and close(metrics["actor/is_clipped_frac"], 1 / 3)


def test_policy_loss_recomputes_missing_behaviour_logprobs_from_the_old_policy() -> None:
    batch = tiny_batch()
    # token (0, 1) was recorded without its logprob (NaN); token (0, 2) is stale by 1 nat
    batch["behaviour_logprobs"] = t([0.0, math.nan, -3.0], [0.0, -1.0, 0.0])
    logp = t([0.0, -1.0, -2.0], [0.0, -1.0, 0.0]).requires_grad_()  # old = logp.detach()
    loss, metrics = rl.policy_loss(logp, batch, rl.LossConfig())
    # IS weights: the missing one takes old itself -> 1; the stale one exp(1) -> truncated to 2
    # per token -A * is_w: row 0 [-, -1, -2], row 1 [-, +2, -] -> 0.25 * -3 + 0.5 * 2 = 0.25
    assert close(loss, 0.25) and math.isfinite(metrics["loss/total"])
    assert close(metrics["actor/behaviour_recomputed_frac"], 1 / 3)  # 1 of the 3 trained tokens
    assert close(metrics["actor/is_weight_mean"], 4 / 3)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    filled, missing = rl.fill_behaviour(batch["behaviour_logprobs"], logp)
    assert missing.tolist() == [[False, True, False], [False, False, False]]
    assert filled[0, 1] == -1.0 and not filled.requires_grad


def test_policy_loss_with_kl_and_token_mean() -> None:
    batch = tiny_batch()
    batch["ref_logprobs"] = batch["behaviour_logprobs"] + t([0.0, LN2, 0.0], [0.0, 0.0, 0.0])
    logp = batch["behaviour_logprobs"].clone().requires_grad_()
    cfg = rl.LossConfig(kl_coef=0.5, kl_kind="k1", agg="token-mean")
    loss, metrics = rl.policy_loss(logp, batch, cfg)
    # pg: (-1 - 1 + 2) / 3 tokens = 0; kl k1 = logp - ref = [-ln 2, 0, 0] -> -ln 2 / 3
    assert close(metrics["loss/pg"], 0.0) and close(metrics["loss/kl"], -LN2 / 3)
    assert close(loss, 0.5 * -LN2 / 3)
    # micro-batch: row 0 alone with whole-batch num_tokens = 3 -> pg (-1 - 1) / 3
    micro = {k: v[:1] for k, v in batch.items()}
    loss0, _ = rl.policy_loss(logp[:1], micro, cfg, num_tokens=3)
    assert close(loss0, -2 / 3 + 0.5 * -LN2 / 3)


def test_policy_loss_missing_inputs() -> None:
    logp = torch.zeros(2, 3)
    for key in ("loss_mask", "advantages", "behaviour_logprobs", "loss_weight"):
        batch = tiny_batch()
        del batch[key]
        with pytest.raises(ValueError, match=f'the batch has no "{key}"'):
            rl.policy_loss(logp, batch, rl.LossConfig())
    with pytest.raises(ValueError, match='no "ref_logprobs"'):
        rl.policy_loss(logp, tiny_batch(), rl.LossConfig(kl_coef=0.1))
    batch = tiny_batch()
    batch["old_logprobs"] = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="same shape"):
        rl.policy_loss(logp, batch, rl.LossConfig())


@SETTINGS
@given(batch=batches(), mode=st.sampled_from(sorted(rl.AGG_MODES)), seed=st.integers(0, 2**16))
def test_property_on_policy_gradient_is_reinforce(batch: tuple, mode: str, seed: int) -> None:
    # with old == logp and no IS correction, d loss / d logp[i, t] = -A_i * (aggregation weight of i, t)
    _, mask, weights, _ = batch
    b, t_ = mask.shape
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t_, generator=g) * 5).requires_grad_()
    adv = torch.randn(b, generator=g)
    data = {"loss_mask": mask, "advantages": adv, "behaviour_logprobs": logp.detach() - 0.3,
            "loss_weight": weights}
    loss, _ = rl.policy_loss(logp, data, rl.LossConfig(is_mode="none", agg=mode))
    (grad,) = torch.autograd.grad(loss, logp)
    tokens = mask.sum(-1, keepdim=True)
    samples = max(float((tokens > 0).sum()), 1.0)
    weight = {
        "token-mean": torch.full_like(mask, 1.0 / max(float(mask.sum()), 1.0)),
        "seq-mean-token-mean": 1.0 / (tokens.clamp_min(1.0) * samples) * torch.ones_like(mask),
        "seq-mean-token-sum": torch.full_like(mask, 1.0 / samples),
        "rollout": weights[:, None].expand_as(mask),
    }[mode]
    assert torch.allclose(grad, -adv[:, None] * weight * mask, atol=1e-6)
