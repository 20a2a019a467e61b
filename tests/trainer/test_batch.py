"""The training step's pure logic (lgt.trainer.run.admission): admission, task order, batches, staleness,
per-rollout weights after filtering. No vLLM, no proxy, no model."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lgt.store.samples import SAMPLES
from lgt.trainer.rl.algorithm import AlgorithmConfig
from lgt.trainer.run import admission as batch

ASYNC = batch.Limits(mode="async", group_size=8, batch_groups=4, max_inflight=64, max_staleness=1)
SYNC = batch.Limits(mode="sync", group_size=8, batch_groups=4, max_inflight=64, max_staleness=1)


def launch_ok(limits: batch.Limits, **kw) -> bool:
    args = {"running_rollouts": 0, "unfinished_groups": 0, "ready_groups": 0, "launched_this_run": 0,
            "updates_this_run": 0, **kw}
    return batch.may_launch(limits, **args)


def test_async_admission_bounds_staleness_and_concurrency() -> None:
    # before the first update: (0 + 1 + max_staleness 1) * 4 = 8 groups may be launched
    assert launch_ok(ASYNC, launched_this_run=7) and not launch_ok(ASYNC, launched_this_run=8)
    # each update makes room for one more batch
    assert launch_ok(ASYNC, launched_this_run=8, updates_this_run=1)
    assert not launch_ok(ASYNC, launched_this_run=12, updates_this_run=1)
    # never more rollouts at once than max_inflight: 57 running + 8 > 64
    assert not launch_ok(ASYNC, running_rollouts=57) and launch_ok(ASYNC, running_rollouts=56)
    staler = batch.Limits("async", 8, 4, 64, max_staleness=0)
    assert not launch_ok(staler, launched_this_run=4)


def test_async_admission_starts_no_group_the_run_could_not_train() -> None:
    # 2 groups left to train: running + ready stay under 2 + one spare batch of 4
    assert launch_ok(ASYNC, unfinished_groups=3, ready_groups=2, groups_left=2)
    assert not launch_ok(ASYNC, unfinished_groups=4, ready_groups=2, groups_left=2)
    assert not launch_ok(ASYNC, unfinished_groups=6, groups_left=2)
    assert launch_ok(ASYNC, unfinished_groups=6, groups_left=None)  # no step or sample limit: no bound
    assert not launch_ok(ASYNC, unfinished_groups=4, groups_left=0)  # the run is over
    assert launch_ok(ASYNC, groups_left=0)  # nothing running: a batch can still start (never a stall)
    # sync launches its step's batch whatever is left
    assert launch_ok(SYNC, unfinished_groups=3, groups_left=1)


def test_sync_launches_one_batch_per_step() -> None:
    assert launch_ok(SYNC, unfinished_groups=3) and not launch_ok(SYNC, unfinished_groups=4)
    assert not launch_ok(SYNC, unfinished_groups=1, ready_groups=3)
    assert launch_ok(SYNC, launched_this_run=100, updates_this_run=0)  # no staleness bound: one batch a step


def test_task_order_visits_every_task_once_per_epoch_and_is_seeded() -> None:
    n = 7
    for epoch in range(3):
        order = [batch.task_index(5, n, epoch * n + i) for i in range(n)]
        assert sorted(order) == list(range(n))
    first = [batch.task_index(5, n, i) for i in range(n)]
    assert first == [batch.task_index(5, n, i) for i in range(n)]  # a restart continues the sequence
    assert first != [batch.task_index(5, n, n + i) for i in range(n)]  # reshuffled each epoch
    assert first != [batch.task_index(6, n, i) for i in range(n)]  # another seed, another order


@dataclass
class G:
    index: int


def test_take_batch_takes_the_oldest_finished_groups() -> None:
    ready = [G(5), G(2), G(9), G(3)]
    taken, rest = batch.take_batch(ready, 2)
    assert [g.index for g in taken] == [2, 3] and [g.index for g in rest] == [5, 9]


def samples(rows: list[tuple[str, str, float, int, int]]) -> pa.Table:
    """SAMPLES rows from (rollout, group, reward, policy version, generated tokens); a rollout given
    twice becomes two samples (its rollout_tokens summed)."""
    tokens = Counter()
    for rid, _, _, _, n in rows:
        tokens[rid] += n
    index = Counter()
    out = []
    for rid, gid, reward, version, n in rows:
        k = index[rid]
        index[rid] += 1
        out.append({"sample_id": f"{rid}~0#{k}", "rollout_id": rid, "attempt": 0, "group_id": gid,
                    "task_id": gid, "sample_index": k, "n_calls": 1, "input_ids": [1] * (2 + n),
                    "loss_mask": [0, 0] + [1] * n, "behaviour_logprobs": [0.0, 0.0] + [-1.0] * n,
                    "policy_versions": [-1, -1] + [version] * n, "reward": reward,
                    "rollout_tokens": tokens[rid], "mode": "exact"})
    return pa.Table.from_pylist(out, schema=SAMPLES)


def weight_per_rollout(t: pa.Table) -> dict[str, float]:
    out: Counter = Counter()
    for r in t.to_pylist():
        out[r["rollout_id"]] += r["loss_weight"] * sum(r["loss_mask"])
    return dict(out)


BATCH = [("a1", "A", 1.0, 5, 3), ("a2", "A", 0.0, 4, 2),  # A's oldest token: version 4
         ("b1", "B", 1.0, 6, 4), ("b2", "B", 0.0, 6, 1), ("b2", "B", 0.0, 6, 5),  # b2: 2 samples
         ("c1", "C", 0.5, 3, 2), ("c2", "C", 1.0, 6, 2)]  # C's oldest: version 3 (c1's 2 tokens)


def test_prepare_by_group_drops_stale_groups_then_weighs_the_rest() -> None:
    p = batch.prepare(samples(BATCH), version=6, algorithm=AlgorithmConfig(), max_staleness=2,
                      staleness="group")
    # at version 6 with max_staleness 2: C (6 - 3 = 3) is dropped whole, A (6 - 4 = 2) stays
    assert set(p.samples["group_id"].to_pylist()) == {"A", "B"} and p.stale_groups == 1
    assert p.rollouts == 4 and max(p.staleness) == 2 and sorted(set(p.staleness)) == [0, 1, 2]
    # each remaining rollout counts once: 1/4, however many samples it became (b2: two)
    assert weight_per_rollout(p.samples) == {r: pytest.approx(1 / 4) for r in ("a1", "a2", "b1", "b2")}
    adv = dict(zip(p.samples["rollout_id"].to_pylist(), p.samples["advantage"].to_pylist()))
    assert adv["a1"] == pytest.approx(-adv["a2"]) and adv["a1"] > 0  # within A only
    m = p.metrics()
    assert (m["rollouts"], m["samples"], m["rollout/stale_dropped"], m["rollout/staleness_max"]) == \
        (4, 5, 1, 2)
    assert m["rollout/reward_mean"] == 0.5
    # 19 tokens generated; C's 4 thrown away with its group, though only c1's 2 were past the bound
    assert (m["rollout/tokens_generated"], m["rollout/tokens_trained"], m["rollout/tokens_stale_masked"],
            m["rollout/tokens_past_bound"]) == (19, 15, 4, 2)
    assert m["rollout/tokens_trained_frac"] == pytest.approx(15 / 19, abs=1e-4)


def test_prepare_by_token_masks_only_the_stale_tokens_and_keeps_their_group() -> None:
    p = batch.prepare(samples(BATCH), version=6, algorithm=AlgorithmConfig(), max_staleness=2,
                      staleness="mask")
    # c1's tokens (version 3) are 3 behind: masked, so its only sample has nothing to train and is left
    # out; C stays, and c2's advantage is taken against c1's reward (0.5 < 1.0)
    assert set(p.samples["group_id"].to_pylist()) == {"A", "B", "C"} and p.stale_groups == 0
    assert "c1" not in p.samples["rollout_id"].to_pylist()
    adv = dict(zip(p.samples["rollout_id"].to_pylist(), p.samples["advantage"].to_pylist()))
    assert adv["c2"] == pytest.approx(1 / (2 ** 0.5 * 0.25 + 1e-6) * 0.25)  # (1 - 0.75) / std 0.354
    assert weight_per_rollout(p.samples) == {r: pytest.approx(1 / 5) for r in ("a1", "a2", "b1", "b2", "c2")}
    m = p.metrics()
    assert (m["rollouts"], m["samples"], m["rollout/stale_dropped"], m["rollout/staleness_max"]) == \
        (5, 6, 0, 2)
    assert (m["rollout/tokens_generated"], m["rollout/tokens_trained"], m["rollout/tokens_stale_masked"],
            m["rollout/tokens_past_bound"]) == (19, 17, 2, 2)


def test_prepare_truncating_trains_every_token() -> None:
    p = batch.prepare(samples(BATCH), version=6, algorithm=AlgorithmConfig(), max_staleness=2,
                      staleness="truncate")
    assert p.samples.num_rows == 7 and p.rollouts == 6
    assert weight_per_rollout(p.samples) == {r: pytest.approx(1 / 6)
                                             for r in ("a1", "a2", "b1", "b2", "c1", "c2")}
    m = p.metrics()
    assert (m["rollout/tokens_trained"], m["rollout/tokens_stale_masked"], m["rollout/tokens_past_bound"],
            m["rollout/tokens_trained_frac"], m["rollout/staleness_max"]) == (19, 0, 2, 1.0, 3)
    with pytest.raises(ValueError, match="staleness must be one of mask, truncate, group, not 'drop'"):
        batch.prepare(samples(BATCH), 6, AlgorithmConfig(), 2, staleness="drop")


def test_prepare_can_leave_out_groups_with_equal_rewards() -> None:
    t = samples([("a1", "A", 1.0, 0, 3), ("a2", "A", 1.0, 0, 2),
                 ("b1", "B", 1.0, 0, 4), ("b2", "B", 0.0, 0, 1)])
    kept = batch.prepare(t, 0, AlgorithmConfig(), max_staleness=1)
    assert kept.zero_variance_groups == 1 and kept.rollouts == 4
    assert {r["rollout_id"]: r["advantage"] for r in kept.samples.to_pylist()}["a1"] == 0.0
    skipped = batch.prepare(t, 0, AlgorithmConfig(skip_zero_variance=True), max_staleness=1)
    assert set(skipped.samples["rollout_id"].to_pylist()) == {"b1", "b2"}
    assert weight_per_rollout(skipped.samples) == {"b1": pytest.approx(0.5), "b2": pytest.approx(0.5)}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from([0.0, 0.5, 1.0]), st.integers(1, 6)),
                min_size=1, max_size=24), st.integers(1, 4))
def test_shares_are_whole_groups_each_weighing_its_rollouts_once(rows, k) -> None:
    t = batch.prepare(samples([(f"r{i}", f"g{g}", w, 0, n) for i, (g, w, n) in enumerate(rows)]), 0,
                      AlgorithmConfig(), max_staleness=0).samples
    parts = batch.shares(t, k, AlgorithmConfig())
    groups = [set(p["group_id"].to_pylist()) for p in parts]
    assert sum(len(g) for g in groups) == len(set(t["group_id"].to_pylist()))  # disjoint, all covered
    assert sum(p.num_rows for p in parts) == t.num_rows
    whole = dict(zip(t["sample_id"].to_pylist(), t["advantage"].to_pylist()))
    for p in parts:
        n = len(set(p["rollout_id"].to_pylist()))
        assert all(v == pytest.approx(1 / n) for v in weight_per_rollout(p).values())
        for sid, a in zip(p["sample_id"].to_pylist(), p["advantage"].to_pylist()):
            assert a == pytest.approx(whole[sid])  # groups stay whole: advantages do not change
