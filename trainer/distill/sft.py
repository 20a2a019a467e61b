"""``lgt-train sft``: supervised fine-tuning on a teacher's recorded traces."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SftConfig:
    """The ``sft:`` section of a run config (``lgt-train sft``)."""

    traces: Path | None = None  # the store holding the teacher's recorded calls
