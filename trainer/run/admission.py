"""Which groups run, which are trained together, and how: the training step's pure logic. No I/O.

A *group* is ``group_size`` rollouts of one task launched under one policy version; advantages are
taken within it. The recipe and its group scheduler (:mod:`lgt.trainer.run.scheduler`) ask these
functions, and only these, what to do next:

* :func:`may_launch` — admission control. ``sync`` launches one batch per step and trains it when every
  group finished; ``async`` keeps launching while the groups launched this run could all still be
  trained within ``max_staleness`` versions: ``launched ≤ (updates this run + 1 + max_staleness) ·
  batch_groups``, and never more than ``max_inflight`` rollouts at once.
* :func:`task_index` — group n's task: the tasks in a seeded shuffled order, reshuffled every epoch, so
  each task is visited once per epoch and a restarted run continues the same sequence.
* :func:`take_batch` — the ``batch_groups`` oldest finished groups.
* :func:`prepare` — a batch's samples as the loss wants them: groups whose oldest generated token is
  more than ``max_staleness`` versions behind the policy being trained are dropped whole (counted;
  admission control keeps that rare); optionally groups with equal rewards; then advantages and loss
  weights over the rollouts that remain (:func:`lgt.trainer.rl.algorithm.assign`: each rollout counts once
  in this step, however many samples it became).
* :func:`prepare_policies` — with several policies, :func:`prepare` on each policy's own samples
  (:func:`lgt.store.samples.split_by_policy`): each policy's advantages and loss weights within its table.
* :func:`shares` — the batch split into ``updates_per_step`` disjoint shares of whole groups, each
  re-weighted so its rollouts count once in its own optimizer step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from lgt.store.samples import split_by_policy
from lgt.trainer.rl.algorithm import AlgorithmConfig, assign


@dataclass(frozen=True)
class Limits:
    """What admission control needs from the run config."""

    mode: str  # sync | async
    group_size: int
    batch_groups: int
    max_inflight: int
    max_staleness: int


def may_launch(limits: Limits, *, running_rollouts: int, unfinished_groups: int, ready_groups: int,
               launched_this_run: int, updates_this_run: int) -> bool:
    """Whether one more group may start now."""
    if running_rollouts + limits.group_size > limits.max_inflight:
        return False
    if limits.mode == "sync":  # one batch per step: launch until the step's batch is complete
        return unfinished_groups + ready_groups < limits.batch_groups
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


def oldest_versions(samples: pa.Table) -> dict[str, int]:
    """Per group: the oldest policy version that generated any of its trained tokens."""
    out: dict[str, int] = {}
    for gid, versions in zip(samples["group_id"].to_pylist(), samples["policy_versions"].to_pylist()):
        gen = [v for v in versions if v is not None and v >= 0]
        if gen:
            out[gid] = min(out.get(gid, gen[0]), min(gen))
    return out


@dataclass(frozen=True)
class Prepared:
    samples: pa.Table  # with advantage, loss_weight, group_size, zero_variance
    rollouts: int  # rollouts trained (R)
    stale_groups: int  # groups dropped for staleness
    zero_variance_groups: int  # groups whose rewards were all equal (dropped with skip_zero_variance)
    staleness: list[int]  # per trained group: versions between its oldest token and the trained policy

    def metrics(self) -> dict[str, Any]:
        s = self.staleness or [0]
        rewards = dict(zip(zip(self.samples["rollout_id"].to_pylist(), self.samples["attempt"].to_pylist()),
                           self.samples["reward"].to_pylist()))
        values = list(rewards.values())
        return {"rollouts": self.rollouts, "samples": self.samples.num_rows,
                "rollout/reward_mean": round(sum(values) / len(values), 4) if values else float("nan"),
                "rollout/stale_dropped": self.stale_groups,
                "rollout/staleness_max": max(s), "rollout/staleness_mean": round(sum(s) / len(s), 3),
                "rollout/zero_variance_groups": self.zero_variance_groups}


def _drop_groups(t: pa.Table, groups: set[str]) -> pa.Table:
    if not groups:
        return t
    return t.filter(pc.invert(pc.is_in(t["group_id"], value_set=pa.array(sorted(groups), pa.string()))))


def prepare(samples: pa.Table, version: int, algorithm: AlgorithmConfig, max_staleness: int) -> Prepared:
    """The batch's samples (the store's rows of its groups) ready for the loss at policy ``version``."""
    oldest = oldest_versions(samples)
    stale = {g for g, v in oldest.items() if version - v > max_staleness}
    t = assign(_drop_groups(samples, stale), algorithm)
    flat = {g for g, z in zip(t["group_id"].to_pylist(), t["zero_variance"].to_pylist()) if z}
    if algorithm.skip_zero_variance and flat:
        t = assign(_drop_groups(t, flat), algorithm)  # the weights count the rollouts that remain
    n_rollouts = len(set(zip(t["rollout_id"].to_pylist(), t["attempt"].to_pylist())))
    kept = set(t["group_id"].to_pylist())
    return Prepared(t, n_rollouts, len(stale), len(flat),
                    [version - v for g, v in oldest.items() if g in kept])


def prepare_policies(samples: pa.Table, policies: list[str], version: int, algorithm: AlgorithmConfig,
                     max_staleness: int) -> tuple[Prepared, dict[str, Prepared]]:
    """Several policies' batch: each of ``policies`` prepared on its own samples (its advantages and loss
    weights within its table, so each rollout counts once in each policy's update; an empty table for a
    policy with no call in the batch), and the batch as one for the step's row: the policies' tables
    together, its counts (stale and zero-variance groups, staleness) those of :func:`prepare` on the
    whole batch. Samples of a policy not in ``policies`` are not trained."""
    tables = split_by_policy(samples)
    empty = samples.slice(0, 0)
    each = {name: prepare(tables.get(name, empty), version, algorithm, max_staleness) for name in policies}
    whole = prepare(samples, version, algorithm, max_staleness)
    trained = [p.samples for p in each.values() if p.samples.num_rows]
    table = pa.concat_tables(trained, promote_options="permissive") if trained else whole.samples.slice(0, 0)
    rollouts = len(set(zip(table["rollout_id"].to_pylist(), table["attempt"].to_pylist())))
    return Prepared(table, rollouts, whole.stale_groups, whole.zero_variance_groups, whole.staleness), each


def shares(samples: pa.Table, k: int, algorithm: AlgorithmConfig) -> list[pa.Table]:
    """``samples`` as ``k`` disjoint shares of whole groups (fewer when there are fewer groups), each
    with loss weights over its own rollouts; advantages are unchanged (groups stay whole)."""
    groups = sorted(set(samples["group_id"].to_pylist()))
    if k <= 1 or len(groups) < 2:
        return [samples]
    return [assign(samples.filter(pc.is_in(samples["group_id"], value_set=pa.array(groups[i::k]))), algorithm)
            for i in range(min(k, len(groups)))]
