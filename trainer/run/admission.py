"""Which groups run, which are trained together, and how: the training step's pure logic. No I/O.

A *group* is ``group_size`` rollouts of one task launched under one policy version; advantages are
taken within it. The recipe and its group scheduler (:mod:`lgt.trainer.run.scheduler`) ask these
functions, and only these, what to do next:

* :func:`may_launch` — admission control. ``sync`` launches one batch per step and trains it when every
  group finished; ``async`` keeps launching while the groups launched this run could all still be
  trained within ``max_staleness`` versions: ``launched ≤ (updates this run + 1 + max_staleness) ·
  batch_groups``, and never more than ``max_inflight`` rollouts at once. This bound stays as it was
  when stale groups were dropped: it is what keeps the data near the policy (with ``staleness:
  truncate`` the only bound; AReaL bounds its partial rollouts the same way), and launching more
  would not train more tokens but older ones. What changed is what happens to a group that finishes
  late: nothing of it is thrown away for staleness unless a token is itself too old. Near the end of
  a run with a step or sample limit, no group is started that the run could not train: the groups
  running or finished and not trained stay under the groups the run has left to train plus one batch
  (the spare batch lets the last steps take the groups that finish first, as the others do, instead
  of waiting for the slowest) — without it the last steps started rollouts only to cancel them (a
  10-step run of the async benchmark launched 96 groups for 80 trained; now 88, and 8% faster).
* :func:`task_index` — group n's task: the tasks in a seeded shuffled order, reshuffled every epoch, so
  each task is visited once per epoch and a restarted run continues the same sequence.
* :func:`take_batch` — the ``batch_groups`` oldest finished groups.
* :func:`prepare` — a batch's samples as the loss wants them. Staleness is bounded per token: each
  generated token carries the version that generated it (``policy_versions``: a rollout whose calls
  ran across updates, or one call continued across an update, spans several), and a token more than
  ``max_staleness`` versions behind the policy being trained is, by the run's ``staleness``:
  ``truncate`` (the default) — trained like the rest, its importance weight against the behaviour
  logprobs truncated at ``is_cap`` in the loss (:mod:`lgt.trainer.rl.loss`); ``mask`` — left out of
  the loss, its rollout's other tokens and its group trained; ``group`` — its whole group dropped (lgt's
  behaviour before per-token versions, kept to compare). A group is never dropped for one old
  rollout otherwise. Then optionally groups with equal rewards are left out; advantages are taken over
  each group's rollouts, stale ones included, and loss weights over the rollouts with a trained token
  (:func:`lgt.trainer.rl.algorithm.assign`: each rollout counts once in this step, however many
  samples it became, over its trained tokens). The step's counts: generated and trained tokens, tokens
  left out for staleness, tokens past the bound, versions spanned per rollout.
* :func:`prepare_policies` — with several policies, :func:`prepare` on each policy's own samples
  (:func:`lgt.store.samples.split_by_policy`): each policy's advantages and loss weights within its table.
* :func:`shares` — the batch split into ``updates_per_step`` disjoint shares of whole groups, each
  re-weighted so its rollouts count once in its own optimizer step.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lgt.store.samples import split_by_policy
from lgt.trainer.rl.algorithm import AlgorithmConfig, assign, loss_weights, rollout_keys


@dataclass(frozen=True)
class Limits:
    """What admission control needs from the run config."""

    mode: str  # sync | async
    group_size: int
    batch_groups: int
    max_inflight: int
    max_staleness: int


def may_launch(limits: Limits, *, running_rollouts: int, unfinished_groups: int, ready_groups: int,
               launched_this_run: int, updates_this_run: int, groups_left: int | None = None) -> bool:
    """Whether one more group may start now. ``groups_left``: how many more groups the run will
    train before a step or sample limit ends it (:meth:`~lgt.trainer.run.stopping.StopRules.
    groups_left`, an estimate with a sample limit; None: no such limit)."""
    if running_rollouts + limits.group_size > limits.max_inflight:
        return False
    if limits.mode == "sync":  # one batch per step: launch until the step's batch is complete
        return unfinished_groups + ready_groups < limits.batch_groups
    if groups_left is not None and unfinished_groups + ready_groups >= groups_left + limits.batch_groups:
        return False  # the run ends before it could train this group
    return launched_this_run < (updates_this_run + 1 + limits.max_staleness) * limits.batch_groups


def task_index(seed: int, n_tasks: int, group_index: int) -> int:
    """The task of group ``group_index``: a seeded shuffle of the tasks, a new one each epoch."""
    epoch, i = divmod(group_index, n_tasks)
    order = list(range(n_tasks))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[i]


def take_batch(ready: list[Any], batch_groups: int,
               key: Any = lambda g: g.index) -> tuple[list[Any], list[Any]]:
    """``(batch, rest)``: the ``batch_groups`` oldest of the finished groups (by ``key``), and the others."""
    ordered = sorted(ready, key=key)
    return ordered[:batch_groups], ordered[batch_groups:]


STALENESS = ("mask", "truncate", "group")  # what is done with a token more than max_staleness behind


def _flat(t: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values, row of each value)`` of a list column, nulls as -1 (a slice of a table is respected)."""
    col = t[name].combine_chunks() if t.num_rows else pa.array([], t.schema.field(name).type)
    values = pc.fill_null(pc.list_flatten(col), -1).to_numpy(zero_copy_only=False)
    lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    return values, np.repeat(np.arange(t.num_rows), lengths)


def token_staleness(samples: pa.Table, version: int) -> tuple[np.ndarray, np.ndarray]:
    """``(generated, behind)`` over the flattened token lists of ``samples``: whether each token is one
    the policy generated (``loss_mask`` 1), and how many versions its own generating version
    (``policy_versions``) is behind ``version`` (-1 where the version is unknown: never counted stale)."""
    mask, _ = _flat(samples, "loss_mask")
    versions, _ = _flat(samples, "policy_versions")
    generated = mask == 1
    behind = np.where(generated & (versions >= 0), version - versions.astype(np.int64), -1)
    return generated, behind


def oldest_versions(samples: pa.Table) -> dict[str, int]:
    """Per group: the oldest policy version that generated any of its trained tokens."""
    out: dict[str, int] = {}
    for gid, versions in zip(samples["group_id"].to_pylist(), samples["policy_versions"].to_pylist()):
        gen = [v for v in versions if v is not None and v >= 0]
        if gen:
            out[gid] = min(out.get(gid, gen[0]), min(gen))
    return out


def versions_spanned(samples: pa.Table) -> list[int]:
    """Per rollout: how many policy versions its generated tokens span (newest − oldest + 1; 0 for a
    rollout with no generated token of known version)."""
    if not samples.num_rows:
        return []
    mask, rows = _flat(samples, "loss_mask")
    versions, _ = _flat(samples, "policy_versions")
    _, rollout_of = np.unique(rollout_keys(samples).to_numpy(zero_copy_only=False), return_inverse=True)
    n = int(rollout_of.max()) + 1
    known = (mask == 1) & (versions >= 0)
    owner, v = rollout_of[rows[known]], versions[known].astype(np.int64)
    lo, hi = np.full(n, np.iinfo(np.int64).max), np.full(n, -1)
    np.minimum.at(lo, owner, v)
    np.maximum.at(hi, owner, v)
    return np.where(hi >= 0, hi - lo + 1, 0).tolist()


@dataclass(frozen=True)
class Prepared:
    samples: pa.Table  # with advantage, loss_weight, group_size, zero_variance
    rollouts: int  # rollouts trained (R): those with at least one trained token
    stale_groups: int  # groups dropped whole for staleness (staleness "group" only)
    zero_variance_groups: int  # groups whose rewards were all equal (dropped with skip_zero_variance)
    staleness: list[int]  # per trained token: versions between its own version and the trained policy
    tokens_generated: int = 0  # generated tokens in the batch's samples
    tokens_trained: int = 0  # of them, left in the loss
    tokens_stale_masked: int = 0  # of them, left out for staleness (masked, or their group dropped)
    tokens_past_bound: int = 0  # of them, more than max_staleness versions behind (whatever was done)
    spans: list[int] = field(default_factory=list)  # per rollout of the batch: versions its tokens span

    def metrics(self) -> dict[str, Any]:
        s = self.staleness or [0]
        spans = self.spans or [0]
        rewards = dict(zip(zip(self.samples["rollout_id"].to_pylist(), self.samples["attempt"].to_pylist()),
                           self.samples["reward"].to_pylist()))
        values = list(rewards.values())
        return {"rollouts": self.rollouts, "samples": self.samples.num_rows,
                "rollout/reward_mean": round(sum(values) / len(values), 4) if values else float("nan"),
                "rollout/stale_dropped": self.stale_groups,
                "rollout/staleness_max": max(s), "rollout/staleness_mean": round(sum(s) / len(s), 3),
                "rollout/tokens_generated": self.tokens_generated,
                "rollout/tokens_trained": self.tokens_trained,
                "rollout/tokens_trained_frac": round(self.tokens_trained / self.tokens_generated, 4)
                if self.tokens_generated else 1.0,
                "rollout/tokens_stale_masked": self.tokens_stale_masked,
                "rollout/tokens_past_bound": self.tokens_past_bound,
                "rollout/versions_spanned_mean": round(sum(spans) / len(spans), 3),
                "rollout/versions_spanned_max": max(spans),
                "rollout/zero_variance_groups": self.zero_variance_groups}


def _drop_groups(t: pa.Table, groups: set[str]) -> pa.Table:
    if not groups:
        return t
    return t.filter(pc.invert(pc.is_in(t["group_id"], value_set=pa.array(sorted(groups), pa.string()))))


def mask_tokens(samples: pa.Table, drop: np.ndarray) -> pa.Table:
    """``samples`` with ``loss_mask`` 0 on the flattened tokens where ``drop`` is true, and each
    rollout's ``rollout_tokens`` less the tokens masked in its samples (so the loss weights count the
    tokens that are trained)."""
    if not drop.any():
        return samples
    mask, rows = _flat(samples, "loss_mask")
    removed = drop & (mask == 1)
    lengths = pc.fill_null(pc.list_value_length(samples["loss_mask"]), 0).to_numpy(zero_copy_only=False)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    new_mask = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                        pa.array(np.where(removed, 0, mask).astype(np.int8), pa.int8()))
    per_row = np.bincount(rows[removed], minlength=samples.num_rows)
    keys = rollout_keys(samples).to_numpy(zero_copy_only=False)
    _, rollout_of = np.unique(keys, return_inverse=True)
    per_rollout = np.bincount(rollout_of, weights=per_row).astype(np.int64)
    tokens = samples["rollout_tokens"].to_numpy(zero_copy_only=False).astype(np.int64)
    tokens = tokens - per_rollout[rollout_of]
    i, j = samples.schema.get_field_index("loss_mask"), samples.schema.get_field_index("rollout_tokens")
    out = samples.set_column(i, samples.schema.field(i), new_mask)
    return out.set_column(j, samples.schema.field(j), pa.array(tokens, samples.schema.field(j).type))


def _trained_per_row(t: pa.Table) -> np.ndarray:
    """Per sample: its tokens with ``loss_mask`` 1."""
    mask, rows = _flat(t, "loss_mask")
    return np.bincount(rows[mask == 1], minlength=t.num_rows)


def _generated(t: pa.Table) -> int:
    return int(_trained_per_row(t).sum())


def prepare(samples: pa.Table, version: int, algorithm: AlgorithmConfig, max_staleness: int,
            staleness: str = "truncate") -> Prepared:
    """The batch's samples (the store's rows of its groups) ready for the loss at policy ``version``.

    Each generated token's staleness is its own: ``version`` minus the version that generated it
    (``policy_versions``). With ``staleness`` "mask" a token more than ``max_staleness`` behind is
    left out of the loss (``loss_mask`` 0) and the rest of its rollout and group are trained;
    "truncate" trains it like any token (its importance weight against the behaviour logprobs is
    truncated at ``is_cap`` in the loss, as every token's is); "group" drops its whole group (lgt's
    behaviour before per-token versions). Advantages are taken over each group's rollouts, stale or
    not (a rollout's reward is as true late as early); loss weights count the rollouts with at least
    one trained token, each once, over its trained tokens. A sample with no trained token is left out."""
    if staleness not in STALENESS:
        raise ValueError(f"staleness must be one of {', '.join(STALENESS)}, not {staleness!r}")
    generated, behind = token_staleness(samples, version)
    past = generated & (behind > max_staleness)
    n_generated = int(generated.sum())
    spans = versions_spanned(samples)
    stale: set[str] = set()
    t = samples
    if staleness == "group":
        stale = {g for g, v in oldest_versions(samples).items() if version - v > max_staleness}
        t = _drop_groups(samples, stale)
    elif staleness == "mask":
        t = mask_tokens(samples, past)
    t = assign(t, algorithm)
    flat = {g for g, z in zip(t["group_id"].to_pylist(), t["zero_variance"].to_pylist()) if z}
    if algorithm.skip_zero_variance and flat:
        t = _drop_groups(t, flat)
    t = loss_weights(t.filter(pa.array(_trained_per_row(t) > 0)))  # over the rollouts that remain
    n_rollouts = len(set(zip(t["rollout_id"].to_pylist(), t["attempt"].to_pylist())))
    g2, b2 = token_staleness(t, version)
    trained = b2[g2 & (b2 >= 0)]
    n_trained = int(g2.sum())
    return Prepared(t, n_rollouts, len(stale), len(flat), trained.tolist(),
                    tokens_generated=n_generated, tokens_trained=n_trained,
                    tokens_stale_masked=int(past.sum()) if staleness == "mask"
                    else n_generated - _generated(_drop_groups(samples, stale)),
                    tokens_past_bound=int(past.sum()), spans=spans)


def prepare_policies(samples: pa.Table, policies: list[str], version: int, algorithm: AlgorithmConfig,
                     max_staleness: int, staleness: str = "truncate") -> tuple[Prepared, dict[str, Prepared]]:
    """Several policies' batch: each of ``policies`` prepared on its own samples (its advantages and loss
    weights within its table, so each rollout counts once in each policy's update; an empty table for a
    policy with no call in the batch), and the batch as one for the step's row: the policies' tables
    together, its counts (stale and zero-variance groups, staleness, tokens) those of :func:`prepare` on
    the whole batch. Samples of a policy not in ``policies`` are not trained."""
    tables = split_by_policy(samples)
    empty = samples.slice(0, 0)
    each = {name: prepare(tables.get(name, empty), version, algorithm, max_staleness, staleness)
            for name in policies}
    whole = prepare(samples, version, algorithm, max_staleness, staleness)
    trained = [p.samples for p in each.values() if p.samples.num_rows]
    table = pa.concat_tables(trained, promote_options="permissive") if trained else whole.samples.slice(0, 0)
    rollouts = len(set(zip(table["rollout_id"].to_pylist(), table["attempt"].to_pylist())))
    return dataclasses.replace(whole, samples=table, rollouts=rollouts), each


def shares(samples: pa.Table, k: int, algorithm: AlgorithmConfig) -> list[pa.Table]:
    """``samples`` as ``k`` disjoint shares of whole groups (fewer when there are fewer groups), each
    with loss weights over its own rollouts; advantages are unchanged (kept as :func:`prepare` took
    them, over whole groups with their stale rollouts)."""
    groups = sorted(set(samples["group_id"].to_pylist()))
    if k <= 1 or len(groups) < 2:
        return [samples]
    return [loss_weights(samples.filter(pc.is_in(samples["group_id"], value_set=pa.array(groups[i::k]))))
            for i in range(min(k, len(groups)))]
