"""Where training stands: the step, the policy version, what was trained. A checkpoint saves it and a
resumed run starts from it; the recipe alone moves it on, the other components read it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Progress:
    step: int = 0
    version: int = 0  # the policy version the engine serves
    trained_groups: set[str] = field(default_factory=set)
    trained_samples: int = 0
    version_at_start: int = 0  # this process's first version (its engine serves those weights)

    @classmethod
    def from_checkpoint(cls, extra: Mapping[str, Any]) -> Progress:
        """What :meth:`checkpoint` saved (a checkpoint's ``extra``)."""
        version = int(extra.get("version", 0))
        return cls(step=int(extra.get("step", 0)), version=version,
                   trained_groups=set(extra.get("trained_groups", [])),
                   trained_samples=int(extra.get("trained_samples", 0)), version_at_start=version)

    def checkpoint(self) -> dict[str, Any]:
        return {"version": self.version, "step": self.step, "trained_groups": sorted(self.trained_groups),
                "trained_samples": self.trained_samples}

    def trained(self, group_ids: Iterable[str], samples: int) -> None:
        """One step trained these groups (``samples`` samples): the next policy version."""
        self.version += 1
        self.step += 1
        self.trained_groups.update(group_ids)
        self.trained_samples += samples

    @property
    def updates_this_run(self) -> int:
        return self.version - self.version_at_start
