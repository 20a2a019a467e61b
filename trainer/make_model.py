"""Making a model (``model.make``, ``teacher.make``, ``lgt-train make-model``), in one of two ways: the
tiny demo models trained here (:mod:`lgt.trainer.demo.tiny`), or a pretrained model imported from a
GGUF file (:mod:`lgt.trainer.gguf`). Nothing is downloaded either way."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from lgt.trainer.gguf import DTYPES, SOURCES, find_source
from lgt.trainer.model_dir import ModelError, read_chat_template


@dataclass(frozen=True)
class MakeModel:
    """Build a model locally when its path does not exist yet: the run config's ``model.make``, and
    ``teacher.make`` (a stronger teacher the example makes itself, e.g. the same warm start trained
    longer on right answers: ``correct_fraction: 0.95``). One of two kinds:

    - a tiny demo model trained here (:func:`lgt.trainer.demo.tiny.make_model`): ``preset``,
      ``warm_start``, ``seconds`` or ``steps``, ``seed``, ``correct_fraction``;
    - a pretrained model imported from GGUF (:func:`import_gguf`): ``pretrained`` (a name in
      :data:`SOURCES`) or ``gguf`` (a file), and ``dtype``, the weights' type in the folder (``auto``:
      bfloat16 where this machine computes in bf16 natively, else float32).

    Settings of the other kind are refused, so a config says what it builds."""

    preset: str = "demo"
    warm_start: str | None = "arith"  # arith | carry | calc | both | null
    seconds: float = 90.0  # CPU-seconds of warm start (as many steps as this machine makes in them) ...
    steps: int | None = None  # ... or this many steps, the same model on every machine (seconds ignored)
    seed: int = 0
    correct_fraction: float = 0.4  # the warm start's share of right answers (the rest a fixed error)
    pretrained: str | None = None  # import a named pretrained model (SOURCES) ...
    gguf: Path | None = None  # ... or this GGUF file
    dtype: str = "auto"  # an import's weights: auto | bfloat16 | float16 | float32

    def __post_init__(self) -> None:
        if isinstance(self.correct_fraction, bool) or not 0.0 <= self.correct_fraction <= 1.0:
            raise ValueError(f"correct_fraction must be between 0 and 1, not {self.correct_fraction!r}")
        if self.pretrained is not None and self.gguf is not None:
            raise ValueError("pretrained and gguf are two ways to name the model to import: give one")
        if self.pretrained is not None and self.pretrained not in SOURCES:
            raise ValueError(f"pretrained must be one of {', '.join(SOURCES)}, not {self.pretrained!r} "
                             "(or give gguf: a GGUF file)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        tiny = [f.name for f in dataclasses.fields(self) if f.name in TINY_FIELDS
                and getattr(self, f.name) != f.default]
        if self.imported and tiny:
            raise ValueError(f"{tiny[0]} is a setting of the tiny demo models, not of an import from GGUF "
                             f"({'pretrained' if self.pretrained else 'gguf'}): leave it out")
        if not self.imported and self.dtype != "auto":
            raise ValueError("dtype is a setting of a model imported from GGUF (pretrained or gguf); the "
                             "tiny demo models are made in float32")

    @property
    def imported(self) -> bool:
        """A pretrained model imported from GGUF (else a tiny demo model)."""
        return self.pretrained is not None or self.gguf is not None


# The tiny demo models' settings (MakeModel's first group).
TINY_FIELDS = ("preset", "warm_start", "seconds", "steps", "seed", "correct_fraction")


def import_source(make: MakeModel) -> tuple[Path, str | None]:
    """The GGUF file ``make`` imports (``gguf``, or the one named ``pretrained`` found in its package)
    and the chat template lgt writes into the folder for it (a named source's; None: the file's own).
    ModelError when the source's package is missing."""
    if make.gguf is not None:
        return Path(make.gguf), None
    if make.pretrained is None:
        raise ModelError("this model.make builds a tiny demo model, not an import from GGUF")
    path = find_source(make.pretrained)
    template = SOURCES[make.pretrained].chat_template
    return path, read_chat_template(template) if template is not None else None
