"""Make (or reuse) a demo model directory in one call: tokenizer, model and warm start, finished by
``lgt-model.json`` written last. Saved models load with ``transformers`` and serve with vLLM's CPU build
(``--dtype float32``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lgt.store.files import atomic_dir
from lgt.trainer.demo.model import PRESETS, build_model, count_parameters
from lgt.trainer.demo.tasks import TASKS, TinyModelError
from lgt.trainer.demo.warmstart import warm_start

MARKER = "lgt-model.json"  # written last by make_model: its presence means the directory is finished
MARKER_VERSION = 2  # 2: max_position_embeddings 32768 (was 1024)


DEFAULT_CORRECT_FRACTION = 0.4  # warm_start's default share of right answers


def _spec(preset: str, warm_start_task: str | None, seconds: float | None, seed: int,
          exclude: Sequence[str] = (), steps: int | None = None,
          correct_fraction: float = DEFAULT_CORRECT_FRACTION) -> dict[str, Any]:
    excluded = None
    if warm_start_task and exclude:  # which questions, as a digest (the marker stays small)
        excluded = hashlib.sha256("\n".join(sorted(set(exclude))).encode()).hexdigest()[:16]
    if steps is not None:  # a step budget: the same model on every machine (seconds would vary with it)
        seconds = None
    return {"version": MARKER_VERSION, "preset": preset, "seed": seed, "warm_start_task": warm_start_task,
            "warm_start_seconds": seconds if warm_start_task else None,
            "warm_start_steps": steps if warm_start_task else None, "warm_start_excluded": excluded,
            "warm_start_correct_fraction": correct_fraction if warm_start_task else None}


def read_marker(model_dir: str | Path) -> dict[str, Any] | None:
    """The ``lgt-model.json`` of a finished model directory, or None when there is none (or unreadable)."""
    try:
        data = json.loads((Path(model_dir) / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def is_made(out_dir: str | Path, *, preset: str, warm_start_task: str | None, seconds: float | None = 90.0,
            seed: int, exclude: Sequence[str] = (), steps: int | None = None,
            correct_fraction: float = DEFAULT_CORRECT_FRACTION) -> bool:
    """``out_dir`` holds a finished model made by this lgt with these settings. Without ``exclude`` (a run
    that holds no tasks out) a model whose warm start left some questions out serves as well: it saw
    less, never more, so it is reused rather than rebuilt. A marker written before
    ``correct_fraction`` was recorded was made with the default."""
    spec = _spec(preset, warm_start_task, seconds, seed, exclude, steps, correct_fraction)
    marker = read_marker(out_dir)
    if marker is None:
        return False
    if warm_start_task and "warm_start_correct_fraction" not in marker:
        marker = {**marker, "warm_start_correct_fraction": DEFAULT_CORRECT_FRACTION}
    keys = [k for k in spec if not (k == "warm_start_excluded" and spec[k] is None)]
    return all(marker.get(k) == spec[k] for k in keys)


def make_model(out_dir: str | Path, *, preset: str = "demo", warm_start_task: str | None = None,
               seconds: float | None = 90.0, seed: int = 0, progress: bool = True,
               exclude: Sequence[str] = (), steps: int | None = None,
               correct_fraction: float = DEFAULT_CORRECT_FRACTION) -> Path:
    """Tokenizer + model (+ warm start) in ``out_dir``; returns it. ``exclude``: questions the warm start
    never shows (held-out tasks). The warm start trains ``steps`` steps when given (the same model on any
    machine), else ``seconds`` CPU-seconds (as many steps as this machine makes in them), on answers
    right ``correct_fraction`` of the time (1.0: a stronger model, e.g. a distillation teacher).

    Reuses ``out_dir`` when its ``lgt-model.json`` names the same preset, seed, warm-start task,
    budget and excluded questions (see ``is_made``). Otherwise everything is built in a temporary sibling
    directory, ``lgt-model.json`` (spec and warm-start metrics) is written last, and the directory is
    renamed into place -- a crash leaves no half-made model at ``out_dir``. An ``out_dir`` holding
    anything else than an lgt-made model is refused.
    """
    if preset not in PRESETS:
        raise TinyModelError(f"preset {preset!r} is not one of {', '.join(PRESETS)}")
    if warm_start_task is not None and warm_start_task not in TASKS:
        raise TinyModelError(f"warm_start_task {warm_start_task!r} is not one of {', '.join(TASKS)} or None")
    out = Path(out_dir)
    if steps is not None and steps < 1:
        raise TinyModelError(f"steps must be 1 or more, not {steps}")
    if is_made(out, preset=preset, warm_start_task=warm_start_task, seconds=seconds, seed=seed,
               exclude=exclude, steps=steps, correct_fraction=correct_fraction):
        return out
    spec = _spec(preset, warm_start_task, seconds, seed, exclude, steps, correct_fraction)
    marker = read_marker(out)
    if out.exists() and (not out.is_dir() or (marker is None and any(out.iterdir()))):
        raise TinyModelError(f"{out} already exists and is not a model made by lgt: choose another directory")
    with atomic_dir(out) as tmp:
        build_model(tmp, preset=preset, seed=seed)
        metrics = None
        if warm_start_task is not None:
            metrics = warm_start(tmp, task=warm_start_task, seconds=spec["warm_start_seconds"], steps=steps,
                                 seed=seed, progress=progress, exclude=exclude,
                                 correct_fraction=correct_fraction)
        record = {**spec, "parameters": count_parameters(tmp), "warm_start": metrics}
        (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return out
