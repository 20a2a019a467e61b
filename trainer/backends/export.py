"""``lgt-train export RUN_DIR [--step N] --merge OUT``: a run's checkpoint as a full Hugging Face model
folder anyone can serve (vLLM, transformers, …).

A LoRA checkpoint (:func:`~lgt.trainer.backends.checkpoints.is_adapter`) is merged into its base (the
run's model, recorded in ``trainer_state.json``): weights ``W + alpha/r * B A`` saved with the base's
config; a full-model checkpoint is copied as it is, less the trainer's own state. Either way the
tokenizer files and chat template the run trained with come along. Written in a temporary folder beside
``OUT`` and renamed into place: nothing half-written is left.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from lgt.trainer.backends.checkpoints import (
    DONE,
    STATE_FILE,
    CheckpointError,
    is_adapter,
    read_state,
    tokenizer_files,
)

# a checkpoint's files that are the trainer's state, not the model's
TRAINER_FILES = (DONE, STATE_FILE, "optimizer.pt", "rng.pt")
TRAINER_DIRS = ("verl",)


def check_out(out: Path) -> None:
    """ValueError (one sentence) when ``out`` cannot receive the model: it exists and is not an empty
    folder, or its parent folder does not exist."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not empty: give a new folder (or an empty one) to "
                         "write the model to")
    if not out.parent.is_dir():
        raise ValueError(f"{out}'s parent folder {out.parent} does not exist")


def export(ckpt: Path, out: Path) -> str:
    """``ckpt`` written to ``out`` as a full model folder; what was done, in words."""
    check_out(out)
    _, _, base = read_state(ckpt)
    adapter = is_adapter(ckpt)
    if adapter and base == ckpt:
        raise CheckpointError(f"{ckpt} holds a LoRA adapter whose base model (base_model in its "
                              f"{STATE_FILE}) is gone: it cannot be merged without it")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        if adapter:
            from lgt.trainer.backends import lora

            lora.merge(ckpt, base, tmp)
            for src in tokenizer_files(ckpt):
                shutil.copy2(src, tmp / src.name)
            done = f"{ckpt.name}'s LoRA adapter merged into {base}"
        else:
            for src in ckpt.iterdir():
                if src.name in TRAINER_FILES or src.name in TRAINER_DIRS:
                    continue
                (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp / src.name)
            done = f"{ckpt.name}'s model copied"
        if out.exists():
            out.rmdir()  # empty (check_out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return done
