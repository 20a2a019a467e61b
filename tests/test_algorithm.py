"""Advantages and loss weights (lgt.trainer.rl.algorithm): from the store's facts to what the loss needs.

No torch: these run in the proxy's environment, on samples the real sample builder made.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from pathlib import Path

import duckdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from lgt.store.samples import build_samples
from lgt.testing.samples import Agent, Turn, make_tokenizer, reward, rollout, sentence, store_of
from lgt.trainer.rl import algorithm
from lgt.trainer.rl.algorithm import AlgorithmConfig, assign


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return make_tokenizer()


def trained(con: duckdb.DuckDBPyConnection, **cfg) -> dict[str, dict]:
    """The store's samples with advantages and weights, by rollout (each rollout here is one sample)."""
    rows = assign(build_samples(con).samples, AlgorithmConfig(**cfg)).to_pylist()
    return {r["rollout_id"]: r for r in rows}


# --- advantages ---------------------------------------------------------------------------------------

def grpo_store(tmp_path: Path, tok: Tokenizer) -> duckdb.DuckDBPyConnection:
    agent = Agent(tok)
    rng = random.Random(2)
    names = ["a1", "a2", "a3", "a4", "b1", "b2", "c1", "d1", "d2"]
    calls = [c for n in names for c in agent.run(n, [Turn(sentence(rng, 3), sentence(rng, 4) + ".")])]
    rollouts = [rollout(n, f"{n[0]}/step0", status="failed" if n == "a4" else "ok") for n in names]
    rewards = [reward(n, v) for n, v in
               {"a1": 1.0, "a2": 0.0, "a3": 0.5, "a4": 0.0, "b1": 1.0, "b2": 1.0, "c1": 0.3,
                "d1": 0.7}.items()]  # d2: no reward
    return store_of(tmp_path, calls, rollouts=rollouts, rewards=rewards)


def test_grpo_advantages_by_group(tmp_path: Path, tok: Tokenizer) -> None:
    con = grpo_store(tmp_path, tok)
    std, raw = trained(con), trained(con, std_normalize=False)
    # group a: a4 failed, so its reward 0 never enters the group: the group is [1, 0, 0.5]
    mean, sd = statistics.fmean([1.0, 0.0, 0.5]), statistics.stdev([1.0, 0.0, 0.5])  # 0.5, 0.5
    for rid, r in (("a1", 1.0), ("a2", 0.0), ("a3", 0.5)):
        assert std[rid]["advantage"] == pytest.approx((r - mean) / (sd + 1e-6))
        assert raw[rid]["advantage"] == pytest.approx(r - mean)
        assert std[rid]["group_size"] == 3 and not std[rid]["zero_variance"]
    assert std["a1"]["advantage"] == pytest.approx(0.999998)  # (1 - 0.5) / (0.5 + 1e-6)
    # had a4 counted as reward 0, the group would be [1, 0, 0.5, 0]: a1 would get 1.2247
    as_zero = (1 - statistics.fmean([1, 0, 0.5, 0])) / (statistics.stdev([1, 0, 0.5, 0]) + 1e-6)
    assert not math.isclose(std["a1"]["advantage"], as_zero, rel_tol=1e-3)
    # b: equal rewards; c: alone; both flagged with advantage 0 in both modes
    for rid in ("b1", "b2", "c1"):
        assert std[rid]["zero_variance"] and std[rid]["advantage"] == raw[rid]["advantage"] == 0.0
    assert "a4" not in std and "d2" not in std  # failed, and never rewarded: not trained at all
    assert std["d1"]["group_size"] == 1
    report = build_samples(con).report
    assert report["rollouts"] == {"trained": 7, "excluded": {"failed": 1, "no_reward": 1}}
    assert report["groups"] == {"trained": 4, "zero_variance": 3, "single_rollout": 2}


def test_each_estimator_hand_computed() -> None:
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 5.0, 3.0, 3.0])
    groups = np.array([0, 0, 0, 0, 1, 2, 2])
    # group 0: mean 0.5, sample var = 4 * 0.25 / 3 = 1/3, std = 0.57735 -> +-0.5 / (0.57735 + 1e-6)
    # (the population std 0.5 would give +-1); group 1 has one rollout -> 0; group 2 is flat -> 0
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    adv = algorithm.advantages(rewards, groups, AlgorithmConfig())
    assert adv == pytest.approx([a, -a, -a, a, 0, 0, 0], abs=1e-12)
    assert algorithm.advantages(rewards, groups, AlgorithmConfig(std_normalize=False)) == \
        pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0])
    assert algorithm.advantages(rewards, groups, AlgorithmConfig(eps=1.0))[0] == \
        pytest.approx(0.5 / (math.sqrt(1 / 3) + 1.0))
    # rloo: r - mean of the other three: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3
    assert algorithm.advantages(rewards, groups, AlgorithmConfig(estimator="rloo")) == \
        pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0])
    assert algorithm.advantages(rewards, groups, AlgorithmConfig(estimator="reinforce")) == \
        pytest.approx(rewards)
    # three rewards of 0.1: the mean 0.1 * 3 / 3 need not equal 0.1 exactly, yet the group is flat -> 0
    flat = algorithm.advantages(np.array([0.1, 0.1, 0.1]), np.zeros(3, int), AlgorithmConfig())
    assert list(flat) == [0, 0, 0]
    assert algorithm.advantages(np.zeros(0), np.zeros(0, int), AlgorithmConfig()).shape == (0,)
    with pytest.raises(ValueError, match="finite"):
        algorithm.advantages(np.array([1.0, math.nan]), np.array([0, 0]), AlgorithmConfig())


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(st.lists(st.integers(-8, 8), min_size=1, max_size=6), min_size=1, max_size=5),
       shift=st.integers(-20, 20), estimator=st.sampled_from(["grpo", "rloo"]), std_normalize=st.booleans())
def test_property_group_baselines_sum_to_zero_and_ignore_a_constant(groups, shift, estimator,
                                                                    std_normalize) -> None:
    cfg = AlgorithmConfig(estimator=estimator, std_normalize=std_normalize)
    rewards = np.array([r / 4 for g in groups for r in g])
    index = np.array([i for i, g in enumerate(groups) for _ in g])
    adv = algorithm.advantages(rewards, index, cfg)
    for i in range(len(groups)):
        assert abs(adv[index == i].sum()) < 1e-9
    shifted = rewards + np.where(index == 0, float(shift), 0.0)  # a constant added to group 0 only
    assert algorithm.advantages(shifted, index, cfg) == pytest.approx(adv, abs=1e-9)


def test_algorithm_config_errors_name_the_setting() -> None:
    for kwargs, message in (({"estimator": "ppo"}, "unknown advantage estimator 'ppo'; choose one of: "
                                                   "grpo, rloo, reinforce"),
                            ({"is_mode": "trunc"}, "unknown importance-sampling mode 'trunc'"),
                            ({"agg": "mean"}, "unknown loss aggregation 'mean'"),
                            ({"kl_kind": "k4"}, "unknown KL estimator 'k4'"),
                            ({"sample_mode": "fuzzy"}, "unknown sample mode 'fuzzy'"),
                            ({"clip_low": 1.5}, "clip_low must be in [0, 1)"),
                            ({"dual_clip": 0.5}, "dual_clip must be a finite number > 1"),
                            ({"eps": -1.0}, "eps must be a finite number >= 0")):
        with pytest.raises(ValueError) as e:
            AlgorithmConfig(**kwargs)
        assert str(e.value).startswith(message), (kwargs, str(e.value))


# --- loss weights -------------------------------------------------------------------------------------

def split_store(tmp_path: Path, tok: Tokenizer) -> duckdb.DuckDBPyConnection:
    """Three rollouts of one group that split into 1, 2 and 5 samples (history dropped each call)."""
    agent = Agent(tok)
    rng = random.Random(3)
    calls = []
    for rid, n_samples, n_calls in (("one", 1, 4), ("two", 2, 3), ("five", 5, 5)):
        forget = set(rng.sample(range(1, n_calls), n_samples - 1))
        calls += agent.run(rid, [Turn(sentence(rng, 3), sentence(rng, rng.randint(2, 30)) + ".",
                                      forget=k in forget) for k in range(n_calls)])
    rollouts = [rollout(r, "g/0") for r in ("one", "two", "five")]
    rewards = [reward(r, v) for r, v in (("one", 1.0), ("two", 0.0), ("five", 0.5))]
    return store_of(tmp_path, calls, rollouts=rollouts, rewards=rewards)


def test_each_rollout_counts_once_however_it_split(tmp_path: Path, tok: Tokenizer) -> None:
    rows = assign(build_samples(split_store(tmp_path, tok)).samples, AlgorithmConfig()).to_pylist()
    assert Counter(r["rollout_id"] for r in rows) == {"one": 1, "two": 2, "five": 5}
    # L = sum over samples of loss_weight * sum_t mask * l: with l = 1 on every token, each
    # rollout contributes sum(loss_weight * masked tokens) = 1/R = 1/3
    share = Counter()
    for r in rows:
        share[r["rollout_id"]] += r["loss_weight"] * sum(r["loss_mask"])
    assert share == {k: pytest.approx(1 / 3) for k in ("one", "two", "five")}
    # and with a per-token loss that differs by rollout, L is the mean of the rollouts' token means
    loss = {"one": 0.2, "two": 1.0, "five": 3.0}
    total = sum(r["loss_weight"] * sum(r["loss_mask"]) * loss[r["rollout_id"]] for r in rows)
    assert total == pytest.approx(statistics.fmean(loss.values()))
    # every sample of a rollout carries the rollout's advantage
    assert len({(r["rollout_id"], r["advantage"]) for r in rows}) == 3


def test_per_row_normalisation_would_not_weigh_rollouts_equally(tmp_path: Path, tok: Tokenizer) -> None:
    rows = build_samples(split_store(tmp_path, tok)).samples.to_pylist()
    # the common aggregation: mean over samples (rows) of each sample's mean token loss. A sample
    # weighs 1/S whatever its rollout, so a rollout weighs (its samples) / S: 1/8, 2/8, 5/8.
    share = Counter()
    for r in rows:
        share[r["rollout_id"]] += 1 / len(rows)
    assert share == {"one": pytest.approx(1 / 8), "two": pytest.approx(2 / 8), "five": pytest.approx(5 / 8)}
    loss = {"one": 0.2, "two": 1.0, "five": 3.0}
    per_row = statistics.fmean(loss[r["rollout_id"]] for r in rows)
    assert per_row == pytest.approx((0.2 + 2 * 1.0 + 5 * 3.0) / 8)
    assert not math.isclose(per_row, statistics.fmean(loss.values()), rel_tol=1e-3)


def test_weights_are_over_the_rollouts_given(tmp_path: Path, tok: Tokenizer) -> None:
    # a trainer drops stale groups, then assigns: the weights count only the rollouts it trains
    samples = build_samples(grpo_store(tmp_path, tok)).samples
    some = samples.filter(np.isin(samples["group_id"].to_numpy(zero_copy_only=False), ["a/step0", "c/step0"]))
    rows = assign(some, AlgorithmConfig()).to_pylist()
    per_rollout = Counter()
    for r in rows:
        per_rollout[r["rollout_id"]] += r["loss_weight"] * sum(r["loss_mask"])
    assert per_rollout == {k: pytest.approx(1 / 4) for k in ("a1", "a2", "a3", "c1")}
    assert assign(samples.slice(0, 0), AlgorithmConfig()).num_rows == 0
