"""On-policy distillation: a teacher engine scores each token the student generated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TeacherSection:
    """The ``teacher:`` section of a run config (``algorithm.estimator: opd``)."""

    path: Path | None = None
