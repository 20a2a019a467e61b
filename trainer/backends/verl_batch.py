"""lgt's samples as verl's batch: store samples -> verl's padded ``DataProto``, and what the actors do to
that batch before verl's update (rows padded to whole micro-batches, rank-major order, behaviour
logprobs filled or recomputed).

How a store sample maps onto verl's row (``samples_to_dataproto``):

* A sample is one merged multi-turn token sequence: prompt, generated tokens, tool/environment tokens,
  generated tokens, ... with ``loss_mask`` 1 on the generated ones. verl splits a row into
  ``prompt | response``; the split is the FIRST generated token. ``prompts`` = the tokens before it
  (left-padded), ``responses`` = every token from it on (right-padded); tool tokens inside the response
  get ``response_mask`` 0, so ``response_mask`` selects exactly the sample's ``loss_mask`` tokens.
* ``old_log_probs`` = the recorded ``behaviour_logprobs`` of the response tokens (verl's "bypass" mode:
  the PPO ratio is taken against the engine's behaviour policy, so clipping bounds the step from the
  policy that generated the tokens; no separate old-policy forward pass and no extra IS weight).
  ``VerlConfig(old_logprobs="recompute")`` instead takes them from a forward pass of the policy being
  trained (before the update) and corrects for the behaviour/old mismatch with importance weights
  (``lgt.trainer.rl.loss.importance_weights``: truncated or masked IS) passed as verl's
  ``rollout_is_weights``, which verl's PPO loss multiplies into the per-token loss.
* ``advantages`` = the sample's (rollout's) advantage broadcast over ``response_mask``; with a
  ``token_advantage`` column (on-policy distillation's per-token advantages,
  :mod:`lgt.trainer.distill.opd`) each response token's own instead.
* Loss weights: lgt's ``rollout`` aggregation (each rollout counts once: ``Σ_i w_i Σ_t l_it`` with
  ``w_i = loss_weight``) maps EXACTLY onto verl's ``token-sum`` aggregation with ``w_i`` folded into
  the advantages: every term of verl's (dual-)clipped PPO loss is linear in the advantage and its
  branch depends only on the advantage's sign, so for ``w > 0``
  ``pg_loss(w·A) = w·pg_loss(A)`` token by token. What this does not carry: verl's entropy and KL
  terms are aggregated with the same mode, unweighted, so ``VerlConfig`` refuses them with
  ``loss_agg_mode="rollout"``; the ``actor/pg_clipfrac``-style metrics are unweighted token means.
  verl's own modes (``token-mean``, ``seq-mean-token-mean``, ...) pass through with plain advantages.
  When ``ppo_mini_batch_size`` splits a batch into several optimizer steps, each step's loss is its
  mini-batch's share of the weighted sum (the weights are not renormalised per mini-batch).
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import torch

from lgt.trainer.backends import verl_platform  # noqa: F401  (first: verl's CPU platform, before verl)

# isort: split
from verl import DataProto

from lgt.trainer.backends.base import VerlConfig
from lgt.trainer.backends.samples import SampleError, TokenBatch, read_samples
from lgt.trainer.rl.loss import fill_behaviour, importance_weights


def samples_to_dataproto(
    samples: pa.Table,
    *,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
    pad_token_id: int,
    temperature: float = 1.0,
    fold_loss_weight: bool = False,
) -> DataProto:
    """Turn store samples (``SAMPLES`` schema, B rows) into verl's padded actor batch: read and checked
    by :func:`~lgt.trainer.backends.samples.read_samples` as for every backend, split into prompt and
    response (:func:`split_points`), padded (:func:`widths`, :func:`padded_rows`), the advantages put on
    the response tokens (:func:`response_advantages`).

    Widths: P = ``max_prompt_len`` (or the longest prompt), R = ``max_response_len`` (or the longest
    response); a sample longer than a given cap is an error (it is never cut: cutting a prompt would
    change what the recorded logprobs were conditioned on).

    Returns a ``DataProto`` whose batch holds
      ``prompts`` (B, P) int64, left-padded with ``pad_token_id``;
      ``responses`` (B, R) int64, right-padded;
      ``input_ids`` (B, P+R) = prompts | responses;  ``attention_mask`` (B, P+R) int64, 1 on real tokens;
      ``position_ids`` (B, P+R) int64, 0.. over the real tokens (verl's ``cumsum(mask) - 1`` clipped at
      0: left padding at 0, right padding repeating the last position);
      ``response_mask`` (B, R) int64 = the sample's ``loss_mask`` over the response part;
      ``old_log_probs`` (B, R) float32 = ``behaviour_logprobs`` there (0 off the mask; NaN where the
      proxy recorded none: ``VerlInProcessActor.train_step`` recomputes those);
      ``advantages`` (B, R) float32 = advantage (× ``loss_weight`` when ``fold_loss_weight``) on the
      mask, 0 elsewhere; with a ``token_advantage`` column (list<float32> aligned with ``input_ids``)
      each token's own advantage in place of the sample's;
    ``non_tensor_batch["uid"]`` the sample ids; ``meta_info``: ``temperature`` (the sampling temperature
    the behaviour logprobs were recorded at; verl divides the logits by it).
    """
    batch = read_samples(samples)
    if not (temperature > 0 and math.isfinite(temperature)):
        raise SampleError(f"temperature must be a positive number, got {temperature!r}.")
    prompt_lens = split_points(batch, fold_loss_weight=fold_loss_weight)
    width_p, width_r = widths(batch, prompt_lens, max_prompt_len, max_response_len)
    rows = padded_rows(batch, prompt_lens, width_p, width_r, pad_token_id)
    advantages = response_advantages(batch, rows.pop("token_advantages", None), rows["response_mask"],
                                     fold_loss_weight=fold_loss_weight)
    tensors = {key: torch.from_numpy(value) for key, value in rows.items()} | {
        "advantages": torch.from_numpy(advantages)}
    return DataProto.from_dict(tensors=tensors,
                               non_tensors={"uid": np.array(batch.sample_ids.to_pylist(), dtype=object)},
                               meta_info={"temperature": float(temperature)})


def split_points(batch: TokenBatch, *, fold_loss_weight: bool = False) -> np.ndarray:
    """Each sample's prompt length (N,): the index of its first generated token, where verl's row splits
    into ``prompt | response``. SampleError for a sample without a generated token or without a
    prompt, and (``fold_loss_weight``) one whose ``loss_weight`` is not > 0."""
    no_generated = np.flatnonzero(batch.masked == 0)
    if len(no_generated):
        sid = batch.sample_id(int(no_generated[0]))
        raise SampleError(f"sample {sid!r} has no generated token (loss_mask is all 0).")
    generated = np.flatnonzero(batch.loss_mask)
    firsts = generated[np.searchsorted(generated, batch.starts)] - batch.starts  # each row has one
    no_prompt = np.flatnonzero(firsts == 0)
    if len(no_prompt):
        sid = batch.sample_id(int(no_prompt[0]))
        raise SampleError(f"sample {sid!r} starts with a generated token: it has no prompt.")
    unweighted = np.flatnonzero(batch.loss_weight <= 0) if fold_loss_weight else []
    if len(unweighted):
        i = int(unweighted[0])
        raise SampleError(f"sample {batch.sample_id(i)!r} has loss_weight {batch.loss_weight[i]}, not > 0.")
    return firsts


def widths(batch: TokenBatch, prompt_lens: np.ndarray, max_prompt_len: int | None,
           max_response_len: int | None) -> tuple[int, int]:
    """``(P, R)``: the caps, or the longest prompt and response; SampleError for a sample over a cap (it
    is never cut: cutting a prompt would change what the recorded logprobs were conditioned on)."""
    response_lens = batch.lengths - prompt_lens
    width_p = int(prompt_lens.max()) if max_prompt_len is None else max_prompt_len
    width_r = int(response_lens.max()) if max_response_len is None else max_response_len
    for name, lens, cap in (("prompt", prompt_lens, width_p), ("response", response_lens, width_r)):
        if lens.max() > cap:
            i = int(lens.argmax())
            raise SampleError(
                f"sample {batch.sample_id(i)!r} has a {name} of {int(lens[i])} tokens, over the {name} "
                f"length limit of {cap}.")
    return width_p, width_r


def padded_rows(batch: TokenBatch, prompt_lens: np.ndarray, width_p: int, width_r: int,
                pad_token_id: int) -> dict[str, np.ndarray]:
    """The batch's tokens in verl's padded layout (:func:`samples_to_dataproto`'s keys but
    ``advantages``; ``token_advantages`` (B, R) float64 too when the samples carry them): each token
    put in place at once by its (row, column), prompts right-aligned in (B, P), responses left-aligned
    in (B, R)."""
    n, lengths = len(batch), batch.lengths
    row = np.repeat(np.arange(n), lengths)
    first = np.repeat(prompt_lens, lengths)
    pos = np.arange(len(batch.input_ids)) - np.repeat(batch.starts, lengths)  # within its sample
    prompt = pos < first
    response = ~prompt
    r_row, r_col = row[response], pos[response] - first[response]

    prompts = np.full((n, width_p), pad_token_id, dtype=np.int64)
    prompts[row[prompt], width_p - first[prompt] + pos[prompt]] = batch.input_ids[prompt]
    responses = np.full((n, width_r), pad_token_id, dtype=np.int64)
    responses[r_row, r_col] = batch.input_ids[response]
    response_mask = np.zeros((n, width_r), dtype=np.int64)
    response_mask[r_row, r_col] = batch.loss_mask[response]
    old_lp = np.zeros((n, width_r), dtype=np.float32)
    old_lp[r_row, r_col] = batch.behaviour_logprobs[response]
    old_lp = np.where(response_mask != 0, old_lp, np.float32(0))  # 0 off the mask, whatever was there
    columns = np.arange(width_p + width_r)
    attention = ((columns >= width_p - prompt_lens[:, None])
                 & (columns < width_p + (lengths - prompt_lens)[:, None])).astype(np.int64)
    rows = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention,
        "position_ids": np.clip(np.cumsum(attention, axis=1) - 1, 0, None),
        "response_mask": response_mask,
        "old_log_probs": old_lp,
    }
    if batch.token_advantage is not None:
        token_adv = np.zeros((n, width_r), dtype=np.float64)
        token_adv[r_row, r_col] = batch.token_advantage[response]
        rows["token_advantages"] = token_adv
    return rows


def response_advantages(batch: TokenBatch, token_advantages: np.ndarray | None, response_mask: np.ndarray,
                        *, fold_loss_weight: bool = False) -> np.ndarray:
    """(B, R) float32: each sample's advantage (or its tokens' own, ``token_advantages``) on the response
    mask, × its ``loss_weight`` when ``fold_loss_weight``, 0 elsewhere."""
    per_token = token_advantages if token_advantages is not None else batch.advantage[:, None]
    if fold_loss_weight:
        per_token = per_token * batch.loss_weight[:, None]
    return np.where(response_mask != 0, per_token, 0.0).astype(np.float32)


# -- the batch before verl's update -----------------------------------------------------------------


def pad_batch(batch: DataProto, multiple: int) -> tuple[DataProto, int]:
    """``batch`` grown to a multiple of ``multiple`` rows with copies of its first rows that train on
    nothing (``response_mask``, ``advantages`` and ``old_log_probs`` 0); returns it and the rows added."""
    size = len(batch)
    pad = -size % multiple
    if pad == 0:
        return batch, 0
    filler = batch.select_idxs(np.arange(pad) % size)
    for key in ("response_mask", "advantages", "old_log_probs"):
        filler.batch[key] = torch.zeros_like(filler.batch[key])
    filler.non_tensor_batch["uid"] = np.array([f"{u}#pad" for u in filler.non_tensor_batch["uid"]],
                                              dtype=object)
    return DataProto.concat([batch, filler]), pad


def rank_major_order(size: int, mini: int, world_size: int) -> np.ndarray:
    """Row order for dispatch (rank r gets the r-th contiguous 1/N of the rows) such that rank r's k-th
    mini-batch of ``mini / N`` rows is its share of rows ``[k*mini, (k+1)*mini)``.

    e.g. size 8, mini 4, N 2 -> [0, 1, 4, 5, 2, 3, 6, 7]: rank 0 trains (0, 1) then (4, 5)."""
    per = mini // world_size
    return np.array([k * mini + r * per + i for r in range(world_size) for k in range(size // mini)
                     for i in range(per)], dtype=np.int64)


def fill_missing_behaviour(batch: DataProto, logprobs) -> dict[str, float]:
    """Behaviour logprobs the proxy could not record (NaN) become the current policy's (``logprobs``:
    a ``DataProto -> (B, R)`` forward pass before the update; IS weight 1 there), in place."""
    mask = batch.batch["response_mask"]
    behaviour = batch.batch["old_log_probs"]
    missing = torch.isnan(behaviour) & mask.bool()
    if missing.any():
        filled, _ = fill_behaviour(behaviour, logprobs(batch) * mask)
        batch.batch["old_log_probs"] = torch.where(mask.bool(), filled, torch.zeros_like(filled))
    return {"actor/behaviour_recomputed_frac": float(missing.sum() / mask.sum().clamp_min(1))}


def recompute_old_logprobs(batch: DataProto, logprobs, config: VerlConfig) -> dict[str, float]:
    """``old_log_probs`` become the current policy's and verl's ``rollout_is_weights`` correct for the
    behaviour mismatch (``VerlConfig(old_logprobs="recompute")``), in place."""
    mask = batch.batch["response_mask"]
    behaviour = batch.batch["old_log_probs"]
    old = logprobs(batch) * mask
    weights = importance_weights(old, behaviour, mask, mode=config.loss.is_mode, cap=config.loss.is_cap)
    batch.batch["old_log_probs"] = old
    batch.batch["rollout_is_weights"] = weights
    on = mask.bool()
    return {"actor/behaviour_kl": float((old - behaviour)[on].mean()),
            "actor/is_weight_mean": float(weights[on].mean())}
