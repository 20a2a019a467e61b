"""Fixtures for the trainer's tests (run in the trainer's environment, ``.venv``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 model + local byte-level BPE tokenizer with a ChatML template (HF format)."""
    spec = importlib.util.spec_from_file_location("make_tiny_model",
                                                  HERE.parent / "engine" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("tiny-model")
    mod.main(str(out))
    return out


@pytest.fixture(scope="session")
def arith_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset after a few seconds of the arith warm start (knows the answer format)."""
    from lgt.trainer.demo import tiny

    return tiny.make_model(tmp_path_factory.mktemp("arith-model") / "m", preset="tiny",
                           warm_start_task="arith", seconds=3, progress=False)
