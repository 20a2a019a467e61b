"""Checkpoints every backend writes the same way: a Hugging Face model directory plus the trainer's state.

``<root>/step-<N:08d>/`` (N: the run's step) holds the weights, ``config.json`` and the tokenizer files
(so vLLM can serve it and ``--resume`` can start the engine on it) — or, when the backend trains a LoRA
adapter, the adapter's PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``) and the
tokenizer files, the base being the starting model — ``trainer_state.json`` (``step``: the backend's
update count; the run's ``extra``; the starting model), and whatever the backend needs to continue
exactly (the torch backend's ``optimizer.pt`` and ``rng.pt``, verl's own sharded state under ``verl/``).
It is written in a temporary directory, renamed into place, and ``DONE`` is written last: a directory
without ``DONE`` is unfinished and ignored by :func:`latest_checkpoint`. No torch here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lgt.store.files import fsync_dir, write_atomic

DONE = "DONE"
STATE_FILE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"  # a LoRA checkpoint: PEFT's adapter folder
CHECKPOINT_RE = re.compile(r"^step-(\d+)$")
# Files of a model directory that make up its tokenizer (copied into every checkpoint).
TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                      "chat_template.*", "*.tiktoken", "tiktoken.model", "spiece.model")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be resumed from."""


def tokenizer_files(model_dir: Path) -> list[Path]:
    return sorted({p for pattern in TOKENIZER_PATTERNS for p in Path(model_dir).glob(pattern) if p.is_file()})


def write_checkpoint(root: str | Path, step: int, extra: dict[str, Any] | None, base_model: Path,
                     write: Callable[[Path], None], *, name: int | None = None) -> Path:
    """``root/step-<name:08d>``: ``write(tmp_dir)`` fills it (weights, config, tokenizer, backend
    state), then ``trainer_state.json`` (``step``: the backend's own update count, which resume
    restores), the rename, ``DONE``. ``name`` numbers the folder: a run passes its step (a step may make
    several updates); default ``step``. ``extra`` must be JSON-serialisable (TypeError before anything
    is written). The same name saved again replaces the old copy only once the new one is complete."""
    root = Path(root)
    state = {"step": step, "extra": extra or {}, "base_model": str(Path(base_model).resolve())}
    try:
        state_text = json.dumps(state, indent=1)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint extra must be JSON-serialisable ({e})") from None
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step if name is None else name:08d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write(tmp)
        (tmp / STATE_FILE).write_text(state_text)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = root / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    write_atomic(final / DONE, f"{step}\n", fsync=True)
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(ckpt: str | Path) -> tuple[int, dict[str, Any], Path]:
    """``(step, extra, starting model)`` of a finished checkpoint; CheckpointError otherwise."""
    ckpt = Path(ckpt)
    if not (ckpt / DONE).is_file():
        raise CheckpointError(f"{ckpt} is not a finished checkpoint (it has no {DONE} file): give a run's "
                              "checkpoints/step-N folder (the latest finished one: latest_checkpoint(root))")
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
        step = int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{ckpt}/{STATE_FILE} is unreadable ({e.__class__.__name__}: {e})") from None
    base = Path(state.get("base_model") or ckpt)
    return step, dict(state.get("extra") or {}), base if base.is_dir() else ckpt


def finished_checkpoints(root: str | Path) -> list[Path]:
    """The finished checkpoints (``step-N`` with a ``DONE`` file) under ``root``, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if (m := CHECKPOINT_RE.match(p.name)) and (p / DONE).is_file())
    return [p for _, p in steps]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The finished checkpoint (``step-N`` with a ``DONE`` file) of highest step under ``root``, or None."""
    finished = finished_checkpoints(root)
    return finished[-1] if finished else None


def prune_checkpoints(root: str | Path, keep: int | None) -> list[Path]:
    """Delete all but the newest ``keep`` finished checkpoints under ``root`` (None: delete nothing); the
    ones deleted. Unfinished folders (no ``DONE``) are left alone: a write in progress, or a crash's to
    look at."""
    if keep is None:
        return []
    finished = finished_checkpoints(root)
    old = finished[:-keep] if len(finished) > keep else []
    for p in old:
        # DONE first: a crash mid-delete leaves an unfinished folder, never a damaged "finished" one
        (p / DONE).unlink(missing_ok=True)
        shutil.rmtree(p, ignore_errors=True)
    return old


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``path`` names: a finished ``step-N`` folder as it is, a run folder (or its
    ``checkpoints/``) as its latest finished one; CheckpointError in one sentence otherwise."""
    path = Path(path)
    if (path / DONE).is_file():
        return path
    for root in (path / "checkpoints", path):
        if (found := latest_checkpoint(root)) is not None:
            return found
    if CHECKPOINT_RE.match(path.name):
        raise CheckpointError(f"{path} is not a finished checkpoint (it has no {DONE} file)")
    raise CheckpointError(f"{path} holds no finished checkpoint: give a run's folder or one of its "
                          "checkpoints/step-N folders")


def is_adapter(ckpt: str | Path) -> bool:
    """Whether the checkpoint holds a LoRA adapter (PEFT's folder) rather than a full model."""
    return (Path(ckpt) / ADAPTER_CONFIG).is_file()


def common_step(root: str | Path, names: list[str]) -> str | None:
    """A run of several policies (``root``: its ``checkpoints/policies``): the newest ``step-N`` every
    one of ``names`` finished, or None."""
    finished = [{p.name for p in finished_checkpoints(Path(root) / name)} for name in names]
    common = sorted(set.intersection(*finished)) if finished else []
    return common[-1] if common else None


def checkpoint_at(run_dir: str | Path, step: int | None = None, policy: str | None = None) -> Path:
    """The run's finished checkpoint of ``step`` (default: its latest) — with ``policy``, that policy's
    (a run of several: ``checkpoints/policies/<policy>``); CheckpointError in one sentence when
    ``run_dir`` is no run, has no finished checkpoint, or none of that step."""
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    if not run_dir.is_dir() or not (root.is_dir() or (run_dir / "config.json").is_file()):
        raise CheckpointError(f"{run_dir} is not a run folder (no such folder, or it has neither "
                              "checkpoints/ nor config.json): give the folder lgt-train run wrote")
    if policy is not None:
        root = root / "policies" / policy
    finished = finished_checkpoints(root)
    if not finished:
        raise CheckpointError(f"{run_dir} has no finished checkpoint of policy {policy}" if policy else
                              f"{run_dir} has no finished checkpoint (checkpoints/step-N with a {DONE} file)")
    if step is None:
        return finished[-1]
    by_step = {int(m.group(1)): p for p in finished if (m := CHECKPOINT_RE.match(p.name))}
    if step not in by_step:
        raise CheckpointError(f"{root if policy else run_dir} has no finished checkpoint of step {step}: "
                              f"its steps are {', '.join(map(str, sorted(by_step)))}")
    return by_step[step]
