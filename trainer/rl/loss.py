"""The RL math of lgt: pure functions over ``(B, T)`` tensors with explicit masks.

Both trainer backends (torch and verl) use this module, so a loss means the same thing on either.
Shapes: ``B`` samples (rows), ``T`` token positions, ``V`` vocabulary. A *mask* is ``(B, T)`` with 1
on the tokens that are trained (the tokens the model generated: the store's ``loss_mask``) and 0
elsewhere (prompt tokens, tool output, padding). Every function computes in float32 (float64
inputs stay float64) whatever the input dtype, so bf16 logits give float32 log-probabilities.
Modes are registered by name in dicts (``AGG_MODES``, ``IS_MODES``, ``KL_KINDS``); an unknown name
raises ``ValueError`` naming it and listing the choices.

Choices, and where they depart from the usual recipes:

- **Decoupled PPO** (asynchronous training). Three policies meet in one loss: the *behaviour*
  policy that generated the tokens (its log-probabilities recorded by the engine, the store's
  ``behaviour_logprobs``), the trainer's *old* policy (the weights at the start of the update,
  ``old_logprobs``) and the *current* policy (``logp``, with gradient). The PPO ratio
  ``exp(logp - old)`` is clipped as usual; the importance weight ``exp(old - behaviour)``, truncated
  (``"truncate"``, TIS) or used as a 0/1 filter (``"mask"``, MIS), is a detached per-token factor
  that corrects for the behaviour policy being stale (or a different numeric implementation: vLLM
  vs. the trainer). With one update per batch ``old`` defaults to ``logp.detach()``: ratio 1 and
  the loss is REINFORCE with advantages, times the IS weight. IS is token-level only.
- **Staleness per token.** A rollout's tokens may come from several policy versions (calls across
  updates, a call continued across one); each token's IS weight is its own ``exp(old - behaviour)``
  against the logprob the engine recorded for it, so a token is corrected for exactly the version
  that generated it. A token more than ``max_staleness`` versions behind never reaches this module
  with ``staleness: mask`` (its ``loss_mask`` is 0, :func:`lgt.trainer.run.admission.prepare`); with
  ``staleness: truncate`` it is trained, its weight truncated at ``is_cap`` like any token's (a
  ratio past ``cap`` counts in ``actor/is_clipped_frac``). Advantages stay per rollout.
- **Asymmetric clip** ("clip-higher"): ``ratio`` is clipped to ``[1 - clip_low, 1 + clip_high]``
  with ``clip_high`` > ``clip_low`` by default (0.2 / 0.28), so unlikely tokens with positive
  advantage can grow. Optional **dual clip** (``dual_clip=c``, off by default): for negative
  advantages the loss is also capped at ``-A * c``, so a huge ratio cannot blow the loss up.
- ``approx_kl`` (the PPO statistic) is the k3 estimate ``(r - 1) - log r`` of KL(old || current).
- **KL penalty** against a reference policy, added per token: ``k1 = logp - ref``,
  ``k2 = (logp - ref)^2 / 2``, ``k3 = exp(ref - logp) - (ref - logp) - 1`` (low variance, always
  >= 0; its log-ratio clamped to [-20, 20] and value to <= 10 so one odd token cannot dominate).
- Advantages and the ``rollout`` loss weights are per-rollout numbers: :mod:`lgt.trainer.rl.algorithm`
  computes them (no torch), and holds :class:`LossConfig` (re-exported here) so that a run config is
  checked without importing torch; the mode names there are this module's registries' keys.
- **Loss aggregation** (``AGG_MODES``): ``"token-mean"``, ``"seq-mean-token-mean"``,
  ``"seq-mean-token-sum"`` as in verl, and ``"rollout"``: ``Σ_i w_i Σ_t mask·l`` with the store's
  ``loss_weight`` ``w_i = 1 / (R · masked tokens of sample i's rollout)``, so each *rollout* counts
  once however many samples its calls split into (a rollout split in two samples weighs the same as
  one unsplit). All modes take the *whole batch's* ``num_tokens`` / ``num_samples`` so that the sum
  of micro-batch losses equals the whole-batch loss (gradient accumulation needs no rescaling).
  "Samples" counted by default are the rows with at least one masked token.
- ``token_logprobs`` never keeps a float32 ``(B, T, V)`` copy: it walks the ``B·T`` rows in chunks,
  computes ``log_softmax(logits)[target]`` per chunk in float32, saves only the input logits for
  backward and recomputes each chunk's softmax there, straight into the gradient (a custom autograd
  function).
- **Missing behaviour logprobs** (NaN in the store's ``behaviour_logprobs``: the proxy recorded the
  call's tokens but the engine could not give their logprobs, see ``calls.capture``) are recomputed:
  the trainer's own log-probabilities at the start of the update (``old``) stand in for them
  (:func:`fill_behaviour`), so those tokens train with IS weight 1 — exact for an on-policy call,
  uncorrected staleness for a stale one. ``actor/behaviour_recomputed_frac`` says how many.
- Masked positions never leak: per-token outputs are 0 where the mask is 0 (IS weights are 1 there:
  no correction) and values at masked-out positions (even inf/NaN) do not reach sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor

from lgt.trainer.rl import algorithm
from lgt.trainer.rl.algorithm import LossConfig

__all__ = [
    "AGG_MODES",
    "IS_MODES",
    "KL_KINDS",
    "LossConfig",
    "aggregate_loss",
    "fill_behaviour",
    "importance_weights",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "ppo_clip_loss",
    "token_logprobs",
]

# Elements of one float32 chunk in token_logprobs (B * chunk * V): 2**24 floats = 64 MiB.
DEFAULT_CHUNK_ELEMENTS = 2**24
# Largest |log ratio| exponentiated (exp(20) ~ 4.9e8): keeps ratios finite.
MAX_LOG_RATIO = 20.0


def _upcast(x: Tensor) -> Tensor:
    """``x`` as float32, or float64 when it already is."""
    return x if x.dtype == torch.float64 else x.float()


def _unknown(kind: str, value: object, choices: Mapping[str, object]) -> ValueError:
    return ValueError(f"unknown {kind} {value!r}; choose one of: {', '.join(choices)}")


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"these tensors must have the same shape: {listed}")


# --- masks ----------------------------------------------------------------------------------------

def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x·mask over ``dim`` (all dims when None); positions where mask is 0 are ignored even if
    ``x`` is inf or NaN there. ``x``, ``mask``: same shape (or broadcastable). Float32 or wider."""
    x = _upcast(x)
    m = mask.to(x.dtype)
    y = torch.where(m != 0, x * m, torch.zeros((), dtype=x.dtype, device=x.device))
    return y.sum() if dim is None else y.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x·mask / Σ mask over ``dim`` (all dims when None); 0 where the mask is empty."""
    num = masked_sum(x, mask, dim)
    den = mask.to(num.dtype).sum() if dim is None else mask.to(num.dtype).sum(dim)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(num.dtype).tiny), torch.zeros_like(num))


# --- log-probabilities ----------------------------------------------------------------------------

def _chunk_len(batch: int, vocab: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of positions, not {chunk_size}")
        return chunk_size
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, batch * vocab))


def _row_blocks(logits: Tensor) -> list[tuple[int, Tensor]]:
    """``logits`` (B, T, V) as 2-D blocks of rows, each ``(first flat row b·T + t, (rows, V) view)``:
    one (B·T, V) view when the layout allows it (contiguous logits), else one (T, V) view per sample.
    Never a copy."""
    b, t, v = logits.shape
    try:
        return [(0, logits.view(b * t, v))]
    except RuntimeError:
        return [(i * t, logits[i]) for i in range(b)]


def _row_chunks(logits: Tensor, rows: int) -> Iterator[tuple[int, Tensor]]:
    """(first flat row, (<= rows, V) view) over all B·T rows of ``logits``, in order."""
    for base, block in _row_blocks(logits):
        for s in range(0, block.shape[0], rows):
            yield base + s, block[s:s + rows]


def _next_ids(input_ids: Tensor) -> Tensor:
    """(B·T,) int64: the token each logits row predicts, ``input_ids[b, t + 1]``; 0 (unused) for t = T-1."""
    nxt = torch.zeros_like(input_ids)
    nxt[:, :-1] = input_ids[:, 1:]
    return nxt.reshape(-1)


def _scratch(logits: Tensor, dtype: torch.dtype, rows: int) -> tuple[Tensor | None, Tensor]:
    """(staging buffer or None, result buffer), each (n, V) of ``dtype``: the per-chunk working memory,
    allocated once and reused by every chunk.

    Low-precision logits get a staging buffer to be upcast into; then each buffer holds half of
    ``rows`` so that both together hold one chunk. ``n`` >= 1 and at most B·T.
    """
    b, t, v = logits.shape
    staged = logits.dtype != dtype
    n = max(1, min(rows // 2 if staged else rows, b * t))
    stage = torch.empty((n, v), dtype=dtype, device=logits.device) if staged else None
    return stage, torch.empty((n, v), dtype=dtype, device=logits.device)


class _TokenLogprobs(torch.autograd.Function):
    """out[:, t] = log_softmax(logits[:, t-1])[ids[:, t]] for t >= 1, out[:, 0] = 0.

    Walks the B·T logits rows (flattened, so each chunk is one contiguous slice) ``rows`` at a time;
    backward recomputes each chunk's softmax straight into the gradient, so only ``logits`` is saved.
    Every float32 chunk lives in buffers made once per call (``_scratch``): a fresh 64 MiB tensor per
    chunk (what ``.float()`` or ``softmax(dtype=)`` allocate) costs as much on CPU, in page faults, as
    the softmax itself.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, input_ids: Tensor, rows: int) -> Tensor:  # type: ignore[override]
        dtype = torch.promote_types(logits.dtype, torch.float32)
        b, t, v = logits.shape
        nxt = _next_ids(input_ids)
        lp = torch.empty(b * t, dtype=dtype, device=logits.device)  # lp[b·T + t]: log p(ids[b, t+1])
        stage, buf = _scratch(logits, dtype, rows)
        for s, x in _row_chunks(logits, len(buf)):
            n = len(x)
            if stage is not None:
                x = stage[:n].copy_(x)  # upcast
            y = torch.log_softmax(x, -1, out=buf[:n])
            lp[s:s + n] = y.gather(-1, nxt[s:s + n, None]).squeeze(-1)
        ctx.save_for_backward(logits, input_ids)
        ctx.rows = rows
        out = torch.zeros((b, t), dtype=dtype, device=logits.device)
        out[:, 1:] = lp.view(b, t)[:, :-1]
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        # d out[b, t+1] / d logits[b, t, v] = 1[v == ids[b, t+1]] - softmax(logits[b, t])[v]
        logits, input_ids = ctx.saved_tensors
        b, t, v = logits.shape
        dtype = grad_out.dtype
        g = torch.zeros((b, t), dtype=dtype, device=logits.device)
        g[:, :-1] = grad_out[:, 1:]  # g[b, t]: weight of logits row (b, t); 0 for the last position
        g = g.view(-1, 1)
        nxt = _next_ids(input_ids)[:, None]
        grad = torch.empty((b * t, v), dtype=logits.dtype, device=logits.device)
        same = logits.dtype == dtype
        stage, buf = (None, None) if same else _scratch(logits, dtype, ctx.rows)
        for s, x in _row_chunks(logits, ctx.rows if buf is None else len(buf)):
            n = len(x)
            if same:
                p = torch.softmax(x, -1, out=grad[s:s + n])
            else:
                p = torch.softmax(stage[:n].copy_(x), -1, out=buf[:n])
            gs = g[s:s + n]
            p.mul_(-gs).scatter_add_(-1, nxt[s:s + n], gs)
            if not same:
                grad[s:s + n] = p
        grad = grad.view(b, t, v)
        if t:
            grad[:, -1] = 0  # the last position predicts no input token (exactly 0 even for inf logits)
        return grad, None, None


def token_logprobs(logits: Tensor, input_ids: Tensor, *, chunk_size: int | None = None) -> Tensor:
    """Log-probability of each input token under the model that produced ``logits``.

    logits: (B, T, V), any float dtype; input_ids: (B, T) integer. Returns (B, T) float32 (float64
    for float64 logits): ``out[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`` for t >= 1 (the
    logits at position t-1 predict token t) and ``out[:, 0] = 0``, aligned with the store's
    ``loss_mask`` / ``behaviour_logprobs``. Memory: processes ``chunk_size`` positions at a time
    (default: as many as keep one float32 chunk under 2**24 elements), saves only ``logits`` for
    backward (no float32 copy) and writes the gradient straight into one tensor like ``logits``.
    """
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(f"logits must be (B, T, V) and input_ids (B, T); got {tuple(logits.shape)} "
                         f"and {tuple(input_ids.shape)}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"logits must be floating point, not {logits.dtype}")
    b, _, v = logits.shape
    return _TokenLogprobs.apply(logits, input_ids.long(), max(1, b) * _chunk_len(b, v, chunk_size))


# --- importance sampling correction ---------------------------------------------------------------

def _is_ratio(logp_old: Tensor, behaviour_logp: Tensor) -> Tensor:
    log_ratio = (_upcast(logp_old.detach()) - _upcast(behaviour_logp.detach()))
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()


def _is_none(ratio: Tensor, cap: float) -> Tensor:
    return torch.ones_like(ratio)


def _is_truncate(ratio: Tensor, cap: float) -> Tensor:
    return ratio.clamp(max=cap)


def _is_mask(ratio: Tensor, cap: float) -> Tensor:
    return ((ratio >= 1.0 / cap) & (ratio <= cap)).to(ratio.dtype)


IS_MODES: dict[str, Callable[[Tensor, float], Tensor]] = {
    "none": _is_none,          # no correction: weight 1
    "truncate": _is_truncate,  # TIS: min(exp(old - behaviour), cap)
    "mask": _is_mask,          # MIS: 1 where exp(old - behaviour) in [1/cap, cap], else 0
}


def fill_behaviour(behaviour_logp: Tensor, logp_old: Tensor) -> tuple[Tensor, Tensor]:
    """``(behaviour, recomputed)``: the behaviour logprobs with each NaN (not recorded) replaced by the
    old policy's, and the (B, T) bool mask of the replaced positions. Detached."""
    missing = torch.isnan(behaviour_logp)
    filled = torch.where(missing, logp_old.detach().to(behaviour_logp.dtype), behaviour_logp.detach())
    return filled, missing


def importance_weights(logp_old: Tensor, behaviour_logp: Tensor, mask: Tensor, *, mode: str = "truncate",
                       cap: float = 2.0) -> Tensor:
    """Per-token importance weights correcting the behaviour (engine) policy to the old policy.

    logp_old, behaviour_logp, mask: (B, T). Returns (B, T) float32, detached (no gradient flows into
    the weights). ``mode`` in ``IS_MODES``: "none" (1), "truncate" (``min(exp(old - behaviour),
    cap)``), "mask" (1 where ``exp(old - behaviour)`` is within ``[1/cap, cap]``, else 0). Where the
    mask is 0 the weight is 1 (nothing to correct; the loss masks those positions anyway).
    """
    LossConfig(is_mode=mode, is_cap=cap)  # the same checks
    _check_same_shape(logp_old=logp_old, behaviour_logp=behaviour_logp, mask=mask)
    ratio = _is_ratio(logp_old, behaviour_logp)
    w = IS_MODES[mode](ratio, float(cap))
    return torch.where(mask != 0, w, torch.ones_like(w)).detach()


# --- policy-gradient and KL terms -----------------------------------------------------------------

def _broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    a = _upcast(advantages.detach()).to(like.dtype)
    if a.dim() == 1 and a.shape[0] == like.shape[0]:
        return a[:, None].expand_as(like)
    if a.shape != like.shape:
        raise ValueError(f"advantages must be (B,) or (B, T) = {tuple(like.shape)}, not {tuple(a.shape)}")
    return a


def ppo_clip_loss(logp: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor, *,
                  clip_low: float = 0.2, clip_high: float = 0.28,
                  dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, per token.

    logp (B, T) with gradient; logp_old (B, T) (treated as constant); advantages (B, T) or (B,);
    mask (B, T). ``ratio = exp(logp - old)``; ``loss = max(-A·ratio, -A·clip(ratio, 1 - clip_low,
    1 + clip_high))``, and with ``dual_clip = c`` (> 1) the loss of negative-advantage tokens is
    capped at ``-A·c``. Returns (per-token loss (B, T), 0 where the mask is 0; stats of detached
    scalar tensors: ``clipfrac`` (tokens where the clipped term was taken), ``ratio_mean``,
    ``approx_kl`` (k3 estimate of KL(old || current)), and ``dual_clipfrac`` when dual clip is on).
    """
    LossConfig(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)  # the same checks
    _check_same_shape(logp=logp, logp_old=logp_old, mask=mask)
    logp = _upcast(logp)
    log_ratio = (logp - _upcast(logp_old.detach()).to(logp.dtype)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    adv = _broadcast_advantages(advantages, logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    stats = {
        "clipfrac": masked_mean((clipped > unclipped).to(logp.dtype), mask).detach(),
        "ratio_mean": masked_mean(ratio.detach(), mask),
        "approx_kl": masked_mean((ratio - 1.0 - log_ratio).detach(), mask),
    }
    if dual_clip is not None:
        capped = (adv < 0) & (loss > -adv * dual_clip)
        loss = torch.where(capped, -adv * dual_clip, loss)
        stats["dual_clipfrac"] = masked_mean(capped.to(logp.dtype), mask)
    loss = torch.where(mask != 0, loss, torch.zeros_like(loss))
    return loss, stats


def _kl_k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _kl_k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


def _kl_k3(log_ratio: Tensor) -> Tensor:
    # with d = ref - logp: exp(d) - d - 1 >= 0, unbiased for KL(current || ref) on current's samples
    d = (-log_ratio).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (d.exp() - d - 1.0).clamp(max=10.0)


KL_KINDS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _kl_k1, "k2": _kl_k2, "k3": _kl_k3}


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL estimate of the current policy against a reference policy.

    logp (B, T) with gradient, ref_logp (B, T) (constant). Returns (B, T) float32; ``kind`` in
    ``KL_KINDS``: "k1" ``logp - ref``, "k2" ``(logp - ref)^2 / 2``, "k3" ``exp(ref - logp) - (ref -
    logp) - 1`` (>= 0, clamped to <= 10). Not masked: aggregate it with the loss mask.
    """
    if kind not in KL_KINDS:
        raise _unknown("KL estimator", kind, KL_KINDS)
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    logp = _upcast(logp)
    return KL_KINDS[kind](logp - _upcast(ref_logp.detach()).to(logp.dtype))


# --- loss aggregation -----------------------------------------------------------------------------

def _agg_token_mean(per_token: Tensor, mask: Tensor, sample_weights: Tensor | None, num_tokens: float | None,
                    num_samples: float | None) -> Tensor:
    total = masked_sum(per_token, mask)
    if num_tokens is not None:
        return total / float(num_tokens) if num_tokens > 0 else total * 0  # 0 tokens: total is 0
    return total / mask.to(total.dtype).sum().clamp_min(1.0)  # no tokens: total is 0


def _per_rows(total: Tensor, mask: Tensor, num_samples: float | None) -> Tensor:
    if num_samples is not None:
        return total / float(num_samples) if num_samples > 0 else total * 0
    return total / (mask != 0).any(-1).to(total.dtype).sum().clamp_min(1.0)  # no rows: total is 0


def _agg_seq_mean_token_mean(per_token: Tensor, mask: Tensor, sample_weights: Tensor | None,
                             num_tokens: float | None, num_samples: float | None) -> Tensor:
    return _per_rows(masked_mean(per_token, mask, dim=-1).sum(), mask, num_samples)


def _agg_seq_mean_token_sum(per_token: Tensor, mask: Tensor, sample_weights: Tensor | None,
                            num_tokens: float | None, num_samples: float | None) -> Tensor:
    return _per_rows(masked_sum(per_token, mask), mask, num_samples)


def _agg_rollout(per_token: Tensor, mask: Tensor, sample_weights: Tensor | None, num_tokens: float | None,
                 num_samples: float | None) -> Tensor:
    if sample_weights is None:
        raise ValueError('loss aggregation "rollout" needs sample_weights (the samples\' loss_weight column)')
    if sample_weights.shape != per_token.shape[:1]:
        raise ValueError(f"sample_weights must be (B,) = ({per_token.shape[0]},), "
                         f"not {tuple(sample_weights.shape)}")
    per_sample = masked_sum(per_token, mask, dim=-1)
    return (per_sample * _upcast(sample_weights.detach()).to(per_sample.dtype)).sum()


AggFn = Callable[[Tensor, Tensor, Tensor | None, float | None, float | None], Tensor]
AGG_MODES: dict[str, AggFn] = {
    "token-mean": _agg_token_mean,                    # Σ mask·l / num_tokens
    "seq-mean-token-mean": _agg_seq_mean_token_mean,  # Σ_i mean_t l_i / num_samples
    "seq-mean-token-sum": _agg_seq_mean_token_sum,    # Σ_i Σ_t l_i / num_samples
    "rollout": _agg_rollout,                          # Σ_i w_i Σ_t mask·l, w_i = 1 / (R · rollout tokens)
}


assert tuple(AGG_MODES) == algorithm.AGG_MODES and tuple(IS_MODES) == algorithm.IS_MODES \
    and tuple(KL_KINDS) == algorithm.KL_KINDS, "lgt.trainer.rl.algorithm names the modes registered here"


def aggregate_loss(per_token: Tensor, mask: Tensor, mode: str, *, sample_weights: Tensor | None = None,
                   num_tokens: float | None = None, num_samples: float | None = None) -> Tensor:
    """Reduce a per-token loss (B, T) under ``mask`` (B, T) to a scalar; ``mode`` in ``AGG_MODES``.

    "token-mean": ``Σ mask·l / num_tokens`` (default ``mask.sum()``); "seq-mean-token-mean":
    ``Σ_i (Σ_t mask·l_i / Σ_t mask_i) / num_samples``; "seq-mean-token-sum": ``Σ_i Σ_t mask·l_i /
    num_samples`` (default: rows with at least one masked token); "rollout": ``Σ_i w_i Σ_t mask·l_i``
    with ``sample_weights`` w (B,) the store's ``loss_weight`` (each rollout counts once; the weights
    are already global, so num_tokens / num_samples are not used). For micro-batches pass the whole
    batch's ``num_tokens`` / ``num_samples``: the micro-batch losses then sum to the batch loss.
    An empty mask (or num_tokens / num_samples 0) gives 0, still connected to the graph.
    """
    if mode not in AGG_MODES:
        raise _unknown("loss aggregation", mode, AGG_MODES)
    _check_same_shape(per_token=per_token, mask=mask)
    if per_token.dim() != 2:
        raise ValueError(f"per_token and mask must be (B, T), not {tuple(per_token.shape)}")
    for name, value in (("num_tokens", num_tokens), ("num_samples", num_samples)):
        if value is not None and not (math.isfinite(float(value)) and float(value) >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")
    return AGG_MODES[mode](per_token, mask, sample_weights, num_tokens, num_samples)


def top_k_kl(teacher_top: Tensor, student_top: Tensor) -> Tensor:
    """(B, T) per token, ``Σ_j t_j (log t_j − log s_j)`` over the teacher's top k tokens, ``t`` the
    teacher's probabilities renormalised to them and ``log s_j`` the student's own (whole-vocabulary)
    log-probs. ``teacher_top`` / ``student_top``: (B, T, k) log-probs of the same k tokens (a padded
    entry with teacher log-prob -1e9 weighs 0). It is >= 0 (the student's k probabilities sum to at most
    1), 0 only where the student puts all its mass on the k tokens as the teacher does; its gradient is
    the cross-entropy's: it raises the tokens the teacher prefers, in proportion, at the states the
    student reached."""
    _check_same_shape(teacher_top=teacher_top, student_top=student_top)
    t = torch.log_softmax(_upcast(teacher_top), -1)
    return (t.exp() * (t - _upcast(student_top))).sum(-1)


# --- the loss of one (micro-)batch ----------------------------------------------------------------

def _batch_tensor(batch: Mapping[str, Tensor], key: str, why: str) -> Tensor:
    if key not in batch or batch[key] is None:
        raise ValueError(f'the batch has no "{key}" ({why})')
    return batch[key]


def policy_loss(logp: Tensor, batch: Mapping[str, Tensor], cfg: LossConfig, *,
                num_tokens: float | None = None,
                num_samples: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """The loss of one (micro-)batch: ``aggregate(ppo_clip · is_weight + kl_coef · kl)``.

    logp: (B, T) current log-probabilities with gradient (``token_logprobs``). batch:
    "loss_mask" (B, T); "advantages" (B,) or (B, T); "behaviour_logprobs" (B, T) (engine's, 0 off the
    mask, NaN where not recorded: recomputed, see :func:`fill_behaviour`); optional "old_logprobs"
    (B, T) (default ``logp.detach()``: ratio 1), "loss_weight" (B,) (needed by agg "rollout"),
    "ref_logprobs" (B, T) (needed when ``kl_coef`` > 0); "teacher_top_k_logprobs" and
    "student_top_k_logprobs" (B, T, k) (on-policy distillation's top-k: adds ``opd_top_k_coef`` ·
    :func:`top_k_kl`, aggregated like the rest). ``num_tokens`` / ``num_samples``: whole-batch
    totals when this is a micro-batch (see ``aggregate_loss``).
    Returns (scalar loss, metrics). "loss/*" metrics are this micro-batch's contributions (they sum
    over micro-batches to the batch's value; "loss/kl" is before ``kl_coef``); "actor/*" are means
    over this micro-batch's masked tokens.
    """
    mask = _batch_tensor(batch, "loss_mask", "1 on the tokens to train")
    advantages = _batch_tensor(batch, "advantages", "one per sample or per token")
    behaviour = _batch_tensor(batch, "behaviour_logprobs", "the engine's log-probabilities")
    old = batch.get("old_logprobs")
    old = logp.detach() if old is None else old
    _check_same_shape(logp=logp, loss_mask=mask, behaviour_logprobs=behaviour, old_logprobs=old)
    behaviour, recomputed = fill_behaviour(behaviour, old)
    weights = batch.get("loss_weight")
    if cfg.agg == "rollout":
        weights = _batch_tensor(batch, "loss_weight", 'loss aggregation "rollout" weighs samples by it')

    def agg(x: Tensor) -> Tensor:
        return aggregate_loss(x, mask, cfg.agg, sample_weights=weights, num_tokens=num_tokens,
                              num_samples=num_samples)

    is_w = importance_weights(old, behaviour, mask, mode=cfg.is_mode, cap=cfg.is_cap)
    pg, stats = ppo_clip_loss(logp, old, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                              dual_clip=cfg.dual_clip)
    pg_loss = agg(pg * is_w)
    loss = pg_loss
    metrics = {"loss/pg": float(pg_loss.detach())}
    if cfg.kl_coef > 0:
        ref = _batch_tensor(batch, "ref_logprobs",
                            "kl_coef > 0 needs the reference policy's log-probabilities")
        _check_same_shape(logp=logp, ref_logprobs=ref)
        kl_loss = agg(kl_penalty(logp, ref, cfg.kl_kind))
        loss = loss + cfg.kl_coef * kl_loss
        metrics["loss/kl"] = float(kl_loss.detach())
    if "teacher_top_k_logprobs" in batch and "student_top_k_logprobs" in batch:
        top_kl = agg(top_k_kl(batch["teacher_top_k_logprobs"], batch["student_top_k_logprobs"]))
        loss = loss + cfg.opd_top_k_coef * top_kl
        metrics["loss/top_k_kl"] = float(top_kl.detach())
    metrics["loss/total"] = float(loss.detach())
    ratio = _is_ratio(old, behaviour)
    kept = is_w if cfg.is_mode != "truncate" else (ratio <= cfg.is_cap).to(ratio.dtype)
    metrics.update({
        "actor/clipfrac": float(stats["clipfrac"]),
        "actor/ratio_mean": float(stats["ratio_mean"]),
        "actor/approx_kl": float(stats["approx_kl"]),
        "actor/is_weight_mean": float(masked_mean(is_w, mask)),
        "actor/is_clipped_frac": float(masked_mean(1.0 - kept, mask)),
        "actor/behaviour_kl": float(masked_mean(_upcast(old.detach()) - _upcast(behaviour.detach()), mask)),
        "actor/behaviour_recomputed_frac": float(masked_mean(recomputed.float(), mask)),
    })
    if "dual_clipfrac" in stats:
        metrics["actor/dual_clipfrac"] = float(stats["dual_clipfrac"])
    return loss, metrics
