"""When training ends: the run config's step, time and sample limits, and its target reward."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lgt.trainer.report.summary import WINDOW

TARGET_WINDOW = WINDOW  # target_reward is reached when the mean reward of this many last steps reaches it


@dataclass(frozen=True)
class StopRules:
    """When training ends: the run config's ``steps``, ``max_minutes``, ``max_samples``, ``target_reward``."""

    steps: int
    max_minutes: float | None = None
    max_samples: int | None = None
    target_reward: float | None = None

    def limit(self, *, step: int, minutes: float, samples: int) -> str | None:
        """The limit reached before a step (the summary's ``stopped``), or None to train on."""
        if step >= self.steps:
            return f"step limit ({self.steps} steps)"
        if self.max_minutes and minutes >= self.max_minutes:
            return f"time limit ({self.max_minutes:g} min)"
        if self.max_samples is not None and samples >= self.max_samples:
            return f"sample limit ({self.max_samples} samples)"
        return None

    def groups_left(self, *, step: int, samples: int, batch_groups: int, samples_per_group: float) -> int:
        """How many more groups the run trains before its step or sample limit, whichever comes first
        (with a sample limit an estimate: ``samples_per_group`` is what a trained group has given so
        far, or the expected)."""
        left = (self.steps - step) * batch_groups
        if self.max_samples is not None:
            left = min(left, math.ceil((self.max_samples - samples) / max(samples_per_group, 1e-9)))
        return max(left, 0)

    def target(self, recent_rewards: list[float]) -> float | None:
        """The mean reward of the last :data:`TARGET_WINDOW` steps when it reached ``target_reward``."""
        if self.target_reward is None or len(recent_rewards) < TARGET_WINDOW:
            return None
        mean = sum(recent_rewards[-TARGET_WINDOW:]) / TARGET_WINDOW
        return mean if mean >= self.target_reward else None
