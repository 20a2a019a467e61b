"""Staleness bounded per token: a rollout whose tokens came from several policy versions is trained with
each token's own version (lgt.trainer.run.admission.prepare, then lgt.trainer.rl.loss.policy_loss).
No vLLM, no model: tiny hand-computed tables and tensors."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

from lgt.store.samples import SAMPLES
from lgt.trainer.rl import loss as rl
from lgt.trainer.rl.algorithm import AlgorithmConfig, LossConfig
from lgt.trainer.run import admission

LN = math.log


def sample(rid: str, group: str, reward: float, versions: list[int], blp: list[float],
           policy: str = "default") -> dict:
    """One sample of rollout ``rid``: a token per entry of ``versions`` (-1: a prompt or tool token, not
    trained; else the version that generated it) with behaviour logprobs ``blp``."""
    mask = [1 if v >= 0 else 0 for v in versions]
    return {"sample_id": f"{rid}~0#0", "rollout_id": rid, "attempt": 0, "group_id": group, "task_id": group,
            "sample_index": 0, "n_calls": 3, "input_ids": list(range(1, len(versions) + 1)),
            "loss_mask": mask,
            "behaviour_logprobs": blp, "policy_versions": versions, "reward": reward,
            "rollout_tokens": sum(mask), "mode": "exact", "policy": policy}


# r1: prompt, 2 tokens under version 3, a tool's output, 2 under version 4, 1 under version 5 (its calls ran
# across two updates); r2, the other rollout of its group, generated everything under version 3
OLD = -1.0  # the trainer's log-probability of every token (old = current: one update per batch)
R1 = sample("r1", "G", 1.0, [-1, 3, 3, -1, 4, 4, 5],
            [0.0, OLD - 5.0, OLD - 5.0, 0.0, OLD - LN(1.5), OLD - LN(1.5), OLD + LN(2.0)])
R2 = sample("r2", "G", 0.0, [-1, 3, 3, 3], [0.0, OLD, OLD, OLD])


def table(*rows: dict) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=SAMPLES)


def gradient(p: admission.Prepared, cfg: LossConfig) -> torch.Tensor:
    """d loss / d logp of the one sample left in ``p`` (B = 1), with logp = old = OLD everywhere."""
    (row,) = p.samples.to_pylist()
    mask = torch.tensor([row["loss_mask"]], dtype=torch.float32)
    logp = torch.full(mask.shape, OLD, requires_grad=True)
    batch = {"loss_mask": mask, "advantages": torch.tensor([row["advantage"]]),
             "behaviour_logprobs": torch.tensor([row["behaviour_logprobs"]], dtype=torch.float32),
             "loss_weight": torch.tensor([row["loss_weight"]], dtype=torch.float64)}
    loss, _ = rl.policy_loss(logp, batch, cfg)
    loss.backward()
    return logp.grad[0]


def test_a_rollout_spanning_three_versions_is_trained_with_each_tokens_own_version() -> None:
    # trained at version 6, max_staleness 2: r1's version-3 tokens are 3 behind (masked), its version-4
    # and version-5 tokens 2 and 1 behind (trained); all of r2 is 3 behind
    p = admission.prepare(table(R1, R2), version=6, algorithm=AlgorithmConfig(), max_staleness=2,
                          staleness="mask")
    assert p.stale_groups == 0 and p.samples["rollout_id"].to_pylist() == ["r1"]  # r2 has nothing to train
    (row,) = p.samples.to_pylist()
    assert row["loss_mask"] == [0, 0, 0, 0, 1, 1, 1]
    assert row["rollout_tokens"] == 3 and row["loss_weight"] == pytest.approx(1 / 3)  # R = 1, 3 tokens
    # the group is whole for the advantage: r1 (1.0) against r2 (0.0), GRPO with sample std 0.707
    assert row["advantage"] == pytest.approx(0.5 / (0.5 ** 0.5 + 1e-6))
    m = p.metrics()
    assert (m["rollout/tokens_generated"], m["rollout/tokens_trained"], m["rollout/tokens_stale_masked"],
            m["rollout/tokens_past_bound"]) == (8, 3, 5, 5)
    assert (m["rollout/versions_spanned_max"], m["rollout/versions_spanned_mean"]) == (3, 2.0)  # r1 3, r2 1
    assert (m["rollout/staleness_max"], m["rollout/staleness_mean"]) == (2, round((2 + 2 + 1) / 3, 3))
    # d loss / d logp_t = -A · w · is_weight_t with old = current (PPO ratio 1) and each token's own IS
    # weight exp(old - behaviour) truncated at 2: version 4's tokens 1.5, version 5's 0.5; 0 where masked
    a, w = row["advantage"], 1 / 3
    g = gradient(p, LossConfig(agg="rollout", is_mode="truncate", is_cap=2.0))
    assert g.tolist() == pytest.approx([0, 0, 0, 0, -a * w * 1.5, -a * w * 1.5, -a * w * 0.5], abs=1e-6)


def test_truncating_trains_the_stale_tokens_with_their_weight_truncated() -> None:
    p = admission.prepare(table(R1, R2), version=6, algorithm=AlgorithmConfig(), max_staleness=2,
                          staleness="truncate")
    assert sorted(p.samples["rollout_id"].to_pylist()) == ["r1", "r2"] and p.rollouts == 2
    m = p.metrics()
    assert (m["rollout/tokens_trained_frac"], m["rollout/tokens_stale_masked"],
            m["rollout/tokens_past_bound"], m["rollout/staleness_max"]) == (1.0, 0, 5, 3)
    r1 = admission.prepare(table(R1), version=6, algorithm=AlgorithmConfig(estimator="reinforce"),
                           max_staleness=2, staleness="truncate")
    (row,) = r1.samples.to_pylist()
    assert row["loss_mask"] == [0, 1, 1, 0, 1, 1, 1] and row["loss_weight"] == pytest.approx(1 / 5)
    # version 3's tokens: exp(old - behaviour) = e^5, truncated at the cap 2; "mask" IS drops them instead
    a, w = row["advantage"], 1 / 5
    g = gradient(r1, LossConfig(agg="rollout", is_mode="truncate", is_cap=2.0))
    assert g.tolist() == pytest.approx(
        [0, -a * w * 2, -a * w * 2, 0, -a * w * 1.5, -a * w * 1.5, -a * w * 0.5], abs=1e-6)
    g = gradient(r1, LossConfig(agg="rollout", is_mode="mask", is_cap=2.0))
    assert g.tolist() == pytest.approx([0, 0, 0, 0, -a * w, -a * w, -a * w], abs=1e-6)


def test_by_group_the_old_rollout_takes_its_group_with_it() -> None:
    p = admission.prepare(table(R1, R2), version=6, algorithm=AlgorithmConfig(), max_staleness=2,
                          staleness="group")
    assert p.samples.num_rows == 0 and p.stale_groups == 1 and p.rollouts == 0
    m = p.metrics()
    assert (m["rollout/tokens_trained_frac"], m["rollout/tokens_stale_masked"]) == (0.0, 8)


def test_shares_keep_the_advantages_taken_with_the_masked_rollouts() -> None:
    h1 = sample("h1", "H", 1.0, [-1, 6, 6], [0.0, OLD, OLD])
    h2 = sample("h2", "H", 0.5, [-1, 6], [0.0, OLD])
    p = admission.prepare(table(R1, R2, h1, h2), version=6, algorithm=AlgorithmConfig(), max_staleness=2,
                          staleness="mask")
    whole = dict(zip(p.samples["rollout_id"].to_pylist(), p.samples["advantage"].to_pylist()))
    parts = admission.shares(p.samples, 2, AlgorithmConfig())
    assert len(parts) == 2
    for part in parts:
        n = len(set(part["rollout_id"].to_pylist()))
        for rid, adv, w, toks in zip(*(part[c].to_pylist() for c in ("rollout_id", "advantage", "loss_weight",
                                                                      "rollout_tokens"))):
            assert adv == pytest.approx(whole[rid])  # r1's, taken against r2, which no share holds
            assert w == pytest.approx(1 / (n * toks))
    assert whole["r1"] > 0


def test_several_policies_mask_each_policys_stale_tokens() -> None:
    # rollouts a and b of group g: a's coder call ran under version 0 (2 behind at version 2), b's under 2;
    # a's planner call under 2
    coder_a = sample("a", "g", 1.0, [-1, 0, 0], [0.0, OLD, OLD], policy="coder")
    coder_b = {**sample("b", "g", 0.0, [-1, 2, 2], [0.0, OLD, OLD], policy="coder"), "sample_id": "b~0#1"}
    planner_a = {**sample("a", "g", 1.0, [-1, 2], [0.0, OLD], policy="planner"), "sample_id": "a~0#1"}
    whole, each = admission.prepare_policies(table(coder_a, coder_b, planner_a), ["coder", "planner"], 2,
                                             AlgorithmConfig(), 1, staleness="mask")
    coder = each["coder"]
    # the coder trains only b's tokens, with b's advantage taken against a's reward
    assert coder.samples["rollout_id"].to_pylist() == ["b"] and coder.samples["advantage"][0].as_py() < 0
    assert coder.samples["loss_weight"].to_pylist() == [pytest.approx(1 / 2)] and coder.rollouts == 1
    assert each["planner"].samples["rollout_id"].to_pylist() == ["a"]
    assert sorted(whole.samples["sample_id"].to_pylist()) == ["a~0#1", "b~0#1"] and whole.rollouts == 2
    m = whole.metrics()
    assert (m["rollout/tokens_generated"], m["rollout/tokens_trained"], m["rollout/tokens_stale_masked"]) == \
        (5, 3, 2)


def test_by_default_every_generated_token_is_trained_past_the_bound_counted() -> None:
    # staleness: truncate (the default): r2, wholly 3 versions behind, is trained too; nothing is masked
    p = admission.prepare(table(R1, R2), version=6, algorithm=AlgorithmConfig(), max_staleness=2)
    m = p.metrics()
    assert sorted(set(p.samples["rollout_id"].to_pylist())) == ["r1", "r2"] and p.stale_groups == 0
    assert m["rollout/tokens_trained"] == m["rollout/tokens_generated"] > 0
    assert m["rollout/tokens_trained_frac"] == 1.0 and m["rollout/tokens_stale_masked"] == 0
    assert m["rollout/tokens_past_bound"] > 0 and m["rollout/staleness_max"] == 3
