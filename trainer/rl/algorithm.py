"""The RL algorithm's settings and its per-rollout math: advantages and loss weights. No torch.

The store gives facts — each sample's merged tokens, its rollout's reward and group, the policy
versions — and this module turns them into what the loss needs, in one place:

* **advantages** by an estimator registered by name (:data:`ESTIMATORS`, like verl's
  ``register_adv_est``): ``grpo`` (``(r − mean_g) / (std_g + eps)``, or ``r − mean_g`` without
  ``std_normalize``: Dr. GRPO), ``rloo`` (``r − mean of the group's other rewards``), ``reinforce``
  (the reward itself, no baseline), ``opd`` (on-policy distillation: per sample the GRPO group
  advantage, the reward part kept for the logs and mixed in with ``opd_reward_coef``; the per-token
  advantage, teacher minus student logprob, is :mod:`lgt.trainer.distill.opd`'s). GRPO uses the
  *sample* standard deviation (n − 1); a group of one
  or one whose rewards are all equal gets advantage 0 under ``grpo`` and ``rloo`` (``zero_variance``).
  A group is the rollouts of one task in one step that are trained (``group_id``): a failed rollout
  never counts as reward 0.
* **loss weights**: each rollout counts once however many samples its calls became:
  ``loss_weight = 1 / (R · masked tokens of its rollout)`` for the R rollouts of the batch, so
  ``Σ_samples loss_weight · Σ_t mask · l`` weighs every rollout the same (``agg: rollout``).

:func:`assign` does both for a table of samples (the store's ``SAMPLES`` rows); the trainer calls it
on each step's batch (then :func:`loss_weights` once samples with no trained token are left out),
``lgt-train samples`` on the whole store.
``LossConfig`` holds the loss settings used by :mod:`lgt.trainer.rl.loss` (torch) and the verl backend;
their mode names are checked here so that a run config is validated without importing torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# Names of the modes lgt.trainer.rl.loss implements (rl.py checks its registries against these).
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "rollout")
IS_MODES = ("none", "truncate", "mask")
KL_KINDS = ("k1", "k2", "k3")
SAMPLE_MODES = ("exact", "realign")


def _unknown(kind: str, value: object, choices: tuple[str, ...] | dict) -> ValueError:
    return ValueError(f"unknown {kind} {value!r}; choose one of: {', '.join(choices)}")


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class LossConfig:
    """Policy-loss settings (see lgt.trainer.rl.loss's docstring for what each means).

    ``clip_low`` / ``clip_high``: the PPO ratio's clip range ``[1 - low, 1 + high]``; ``dual_clip``: cap
    on the loss of negative advantages (None: off); ``is_mode`` / ``is_cap``: the importance weights
    against the behaviour logprobs; ``kl_coef`` / ``kl_kind``: a KL penalty against the starting
    policy; ``agg``: how per-token losses become one (``rollout``: each rollout counts once);
    ``opd_top_k_coef``: the weight of on-policy distillation's top-k KL term, used when the samples
    carry the teacher's top-k (``teacher.top_k`` > 0).
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    is_mode: str = "truncate"
    is_cap: float = 2.0
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    agg: str = "rollout"
    dual_clip: float | None = None
    opd_top_k_coef: float = 1.0

    def __post_init__(self) -> None:
        if not (0.0 <= _number("clip_low", self.clip_low) < 1.0):
            raise ValueError(f"clip_low must be in [0, 1), not {self.clip_low!r}")
        if _number("clip_high", self.clip_high) < 0.0:
            raise ValueError(f"clip_high must be a finite number >= 0, not {self.clip_high!r}")
        if self.dual_clip is not None and not (_number("dual_clip", self.dual_clip) > 1.0):
            raise ValueError(f"dual_clip must be a finite number > 1 (or None to turn it off), "
                             f"not {self.dual_clip!r}")
        if self.is_mode not in IS_MODES:
            raise _unknown("importance-sampling mode", self.is_mode, IS_MODES)
        if not _number("is_cap", self.is_cap) >= 1.0:
            raise ValueError(f"the importance-weight cap must be a finite number >= 1, not {self.is_cap!r}")
        if _number("kl_coef", self.kl_coef) < 0.0:
            raise ValueError(f"kl_coef must be a finite number >= 0, not {self.kl_coef!r}")
        if self.kl_kind not in KL_KINDS:
            raise _unknown("KL estimator", self.kl_kind, KL_KINDS)
        if self.agg not in AGG_MODES:
            raise _unknown("loss aggregation", self.agg, AGG_MODES)
        if _number("opd_top_k_coef", self.opd_top_k_coef) < 0.0:
            raise ValueError(f"opd_top_k_coef must be a finite number >= 0, not {self.opd_top_k_coef!r}")


@dataclass(frozen=True)
class AlgorithmConfig(LossConfig):
    """The run config's ``algorithm`` section: the loss settings plus how samples and advantages are
    made. ``estimator`` in :data:`ESTIMATORS`; ``std_normalize`` and ``eps`` apply to ``grpo``;
    ``sample_mode``: the store's merge (``exact``, or ``realign`` across re-tokenisation drift);
    ``skip_zero_variance``: leave groups whose rewards are all equal out of the batch;
    ``opd_reward_coef`` (``estimator: opd``): the weight of the group's reward advantage added to each
    generated token's teacher-minus-student log-ratio (0: pure distillation)."""

    estimator: str = "grpo"
    std_normalize: bool = True
    eps: float = 1e-6
    sample_mode: str = "realign"
    skip_zero_variance: bool = False
    opd_reward_coef: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.estimator not in ESTIMATORS:
            raise _unknown("advantage estimator", self.estimator, ESTIMATORS)
        if _number("eps", self.eps) < 0:
            raise ValueError(f"eps must be a finite number >= 0, not {self.eps!r}")
        if self.sample_mode not in SAMPLE_MODES:
            raise _unknown("sample mode", self.sample_mode, SAMPLE_MODES)
        if _number("opd_reward_coef", self.opd_reward_coef) < 0:
            raise ValueError(f"opd_reward_coef must be a finite number >= 0, not {self.opd_reward_coef!r}")


# --- advantage estimators -------------------------------------------------------------------------

# (rewards (N,) float64, group codes (N,) int in 0..G-1, config) -> advantages (N,) float64
Estimator = Callable[[np.ndarray, np.ndarray, AlgorithmConfig], np.ndarray]
ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    def add(fn: Estimator) -> Estimator:
        ESTIMATORS[name] = fn
        return fn
    return add


@dataclass(frozen=True)
class GroupStats:
    """Per group (indexed by group code): size, mean, sample std, and whether all rewards are equal."""

    size: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    flat: np.ndarray  # bool: a group of one, or whose rewards are all equal

    @classmethod
    def of(cls, rewards: np.ndarray, groups: np.ndarray) -> GroupStats:
        n = int(groups.max()) + 1 if len(groups) else 0
        size = np.bincount(groups, minlength=n).astype(np.float64)
        mean = np.bincount(groups, weights=rewards, minlength=n) / np.maximum(size, 1)
        dev = rewards - mean[groups]
        ss = np.bincount(groups, weights=dev * dev, minlength=n)
        lo = np.full(n, np.inf)
        hi = np.full(n, -np.inf)
        np.minimum.at(lo, groups, rewards)
        np.maximum.at(hi, groups, rewards)
        return cls(size, mean, np.sqrt(ss / np.maximum(size - 1, 1)), lo == hi)


@register_estimator("grpo")
def grpo(rewards: np.ndarray, groups: np.ndarray, cfg: AlgorithmConfig) -> np.ndarray:
    """``(r - mean_g) / (std_g + eps)`` (sample std), or ``r - mean_g`` without ``std_normalize``."""
    g = GroupStats.of(rewards, groups)
    adv = rewards - g.mean[groups]
    if cfg.std_normalize:
        adv = adv / (g.std[groups] + cfg.eps)
    return np.where(g.flat[groups], 0.0, adv)


@register_estimator("rloo")
def rloo(rewards: np.ndarray, groups: np.ndarray, cfg: AlgorithmConfig) -> np.ndarray:
    """REINFORCE leave-one-out: ``r - mean of the other rewards of the group`` (= n/(n-1) · (r - mean_g))."""
    g = GroupStats.of(rewards, groups)
    n = g.size[groups]
    adv = (rewards - g.mean[groups]) * n / np.maximum(n - 1, 1)
    return np.where(g.flat[groups], 0.0, adv)


@register_estimator("reinforce")
def reinforce(rewards: np.ndarray, groups: np.ndarray, cfg: AlgorithmConfig) -> np.ndarray:
    """The reward itself (no baseline)."""
    return rewards.copy()


@register_estimator("opd")
def opd(rewards: np.ndarray, groups: np.ndarray, cfg: AlgorithmConfig) -> np.ndarray:
    """On-policy distillation's reward part: GRPO's group advantage (the per-token teacher-minus-student
    log-ratio is added by :func:`lgt.trainer.distill.opd.token_advantages`, which weighs this by
    ``opd_reward_coef``)."""
    return grpo(rewards, groups, cfg)


def advantages(rewards: np.ndarray, groups: np.ndarray, cfg: AlgorithmConfig) -> np.ndarray:
    """``cfg.estimator``'s advantages of rollouts with these rewards and group codes (0..G-1)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    groups = np.asarray(groups, dtype=np.int64)
    if rewards.shape != groups.shape or rewards.ndim != 1:
        raise ValueError(f"rewards and groups must both be (N,); got {rewards.shape} and {groups.shape}")
    if not np.isfinite(rewards).all():
        raise ValueError("every reward must be a finite number")
    if len(rewards) == 0:
        return rewards.copy()
    return ESTIMATORS[cfg.estimator](rewards, groups, cfg)


# --- a batch of samples ---------------------------------------------------------------------------

TRAINING_COLUMNS = (("advantage", pa.float64()), ("loss_weight", pa.float64()), ("group_size", pa.int64()),
                    ("zero_variance", pa.bool_()))


def training_schema(samples_schema: pa.Schema) -> pa.Schema:
    """The store's SAMPLES schema with :data:`TRAINING_COLUMNS` (what :func:`assign` returns)."""
    for name, type_ in TRAINING_COLUMNS:
        samples_schema = samples_schema.append(pa.field(name, type_))
    return samples_schema


def rollout_keys(samples: pa.Table) -> pa.ChunkedArray:
    """``rollout_id~attempt`` of each sample."""
    return pc.binary_join_element_wise(samples["rollout_id"], pc.cast(samples["attempt"], pa.string()), "~")


def assign(samples: pa.Table, cfg: AlgorithmConfig, *, rollouts: int | None = None) -> pa.Table:
    """``samples`` (rows of the store's SAMPLES: ``rollout_id``, ``attempt``, ``group_id``, ``reward``,
    ``rollout_tokens``) with :data:`TRAINING_COLUMNS` set: each rollout's advantage over the rollouts
    of its group in ``samples``, its loss weight over the R rollouts in ``samples`` (or ``rollouts``:
    R when ``samples`` is one chunk of a larger set of whole groups), its group's size and whether
    the group's rewards are all equal. Columns already there are replaced."""
    for name, _ in TRAINING_COLUMNS:
        if name in samples.column_names:
            samples = samples.drop_columns([name])
    n = samples.num_rows
    if n == 0:
        return samples.append_column("advantage", pa.array([], pa.float64())) \
            .append_column("loss_weight", pa.array([], pa.float64())) \
            .append_column("group_size", pa.array([], pa.int64())) \
            .append_column("zero_variance", pa.array([], pa.bool_()))
    keys = rollout_keys(samples).to_numpy(zero_copy_only=False)
    _, first, rollout_of = np.unique(keys, return_index=True, return_inverse=True)
    group_names = samples["group_id"].to_numpy(zero_copy_only=False)[first]
    _, group_of = np.unique(group_names, return_inverse=True)
    rewards = samples["reward"].to_numpy(zero_copy_only=False).astype(np.float64)[first]
    adv = advantages(rewards, group_of, cfg)
    stats = GroupStats.of(rewards, group_of)
    return samples.append_column("advantage", pa.array(adv[rollout_of], pa.float64())) \
        .append_column("loss_weight", _weights(samples, rollouts or len(first))) \
        .append_column("group_size", pa.array(stats.size[group_of][rollout_of].astype(np.int64))) \
        .append_column("zero_variance", pa.array(stats.flat[group_of][rollout_of]))


def _weights(samples: pa.Table, rollouts: int) -> pa.Array:
    tokens = samples["rollout_tokens"].to_numpy(zero_copy_only=False).astype(np.float64)
    return pa.array(1.0 / (rollouts * np.maximum(tokens, 1.0)), pa.float64())


def loss_weights(samples: pa.Table) -> pa.Table:
    """``samples`` (with :data:`TRAINING_COLUMNS`) with ``loss_weight`` over the R rollouts it holds,
    advantages untouched: for a share of a batch, or a batch some of whose samples were left out
    (their rollouts' advantages were taken with them)."""
    if samples.num_rows == 0:
        return samples
    r = len(np.unique(rollout_keys(samples).to_numpy(zero_copy_only=False)))
    i = samples.schema.get_field_index("loss_weight")
    return samples.set_column(i, "loss_weight", _weights(samples, r))
