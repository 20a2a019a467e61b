"""Making a model (``model.make``, ``teacher.make``, ``lgt-train make-model``), in one of two ways: the
tiny demo models trained here (:mod:`lgt.trainer.demo`), or a pretrained model imported from a
GGUF file (:mod:`lgt.trainer.gguf`). Nothing is downloaded either way.

:func:`check_make` says before anything starts whether a ``make`` can be built where it is asked to be;
:func:`make` builds it (or finds it built with the same settings); :func:`import_model` is an import's
half of it, ``lgt-train make-model --from``'s too."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lgt.trainer.gguf import DTYPES, SOURCES, find_source
from lgt.trainer.model_dir import ModelError, check_model_dir, read_chat_template


@dataclass(frozen=True)
class MakeModel:
    """Build a model locally when its path does not exist yet: the run config's ``model.make``, and
    ``teacher.make`` (a stronger teacher the example makes itself, e.g. the same warm start trained
    longer on right answers: ``correct_fraction: 0.95``). One of two kinds:

    - a tiny demo model trained here (:func:`lgt.trainer.demo.factory.make_model`): ``preset``,
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


def check_make(make: MakeModel, path: Path, key: str) -> None:
    """``model.make`` or ``teacher.make`` (``key``), checked before anything starts: settings tiny can
    build or a GGUF file transformers can import (unless that import is made already), a path it may
    build at. ModelError (one sentence) otherwise."""
    from lgt.trainer.demo.factory import read_marker
    from lgt.trainer.demo.model import PRESETS
    from lgt.trainer.demo.tasks import TASKS
    from lgt.trainer.gguf import check_gguf, import_is_made

    if path.exists() and read_marker(path) is None and any(path.iterdir()):
        raise ModelError(f"{key}.path {path} holds something that is not a model made by lgt: "
                         f"choose another path for {key}.make")
    if make.imported:
        try:
            source, template = import_source(make)
            if not import_is_made(path, source, pretrained=make.pretrained, dtype=make.dtype,
                                  chat_template=template):
                check_gguf(source)
        except ModelError as e:
            raise ModelError(f"{key}.make: {e}") from None
        return
    if make.preset not in PRESETS:
        raise ModelError(f"{key}.make.preset must be one of {', '.join(PRESETS)}, not {make.preset!r}")
    if make.steps is not None and make.steps < 1:
        raise ModelError(f"{key}.make.steps must be 1 or more, not {make.steps}")
    if make.warm_start is not None and make.warm_start not in TASKS:
        raise ModelError(f"{key}.make.warm_start must be one of {', '.join(TASKS)} or null, not "
                         f"{make.warm_start!r}")


def import_model(make: MakeModel, path: Path, what: str = "model", *, chat_template: str | None = None,
                 dtype_key: str | None = None, log: Callable[[str], None] = print) -> Path:
    """``make`` (an import from GGUF: ``pretrained`` or ``gguf``) built at ``path`` unless it is there
    already, with ``chat_template`` (else the named source's, else the file's own); ``dtype: auto`` is
    bfloat16 where this machine computes in bf16 natively, else float32, and a line says which and why
    (``dtype_key`` names the setting in it). ModelError (one sentence) for a bad input; nothing is left
    at ``path``."""
    from lgt.trainer.gguf import check_gguf, import_gguf, import_is_made
    from lgt.trainer.serving.hardware import resolve_dtype

    source, template = import_source(make)
    template = chat_template if chat_template is not None else template
    if import_is_made(path, source, pretrained=make.pretrained, dtype=make.dtype, chat_template=template):
        return path
    info = check_gguf(source)  # a file transformers cannot import: one sentence before torch is imported
    device = "cpu"
    if make.dtype == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, why = resolve_dtype(make.dtype, device, key=dtype_key or f"{what}.make.dtype")
    return import_gguf(info, path, dtype=dtype, requested_dtype=make.dtype, chat_template=template,
                       pretrained=make.pretrained, why=why, log=log)


def make(make: MakeModel, path: Path, what: str, *, max_model_len: int | None,
         need_chat_template: bool = False, exclude: Sequence[str] = (),
         log: Callable[[str], None] = print) -> None:
    """The model ``make`` describes built at ``path`` (reused when it was made with the same settings): a
    tiny demo model (its warm start never shown the questions in ``exclude``: the held-out tasks), or an
    import from GGUF; then checked as a model folder the run can serve with ``max_model_len``."""
    from lgt.trainer.demo import factory

    if make.imported:
        import_model(make, path, what, log=log)
        check_model_dir(path, need_chat_template=need_chat_template).check_context(max_model_len)
        return
    budget = dict(seconds=make.seconds, steps=make.steps, seed=make.seed, exclude=list(exclude),
                  correct_fraction=make.correct_fraction)
    made = factory.is_made(path, preset=make.preset, warm_start_task=make.warm_start, **budget)
    if not made:
        size = f"{make.steps} steps" if make.steps else f"~{make.seconds:.0f} s"
        log(f"building the {what} {path} (preset {make.preset}, warm start "
            f"{make.warm_start or 'none'}, {size}, {make.correct_fraction:g} right) ...")
    factory.make_model(path, preset=make.preset, warm_start_task=make.warm_start, progress=not made, **budget)
    info = check_model_dir(path, need_chat_template=need_chat_template)
    info.check_context(max_model_len)
