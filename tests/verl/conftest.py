"""Fixtures for the verl backend's tests (run in verl's environment, ``.venv-verl``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this folder's ``@pytest.mark.gpu`` tests on a machine without CUDA (or without torch)."""
    gpu_items = [item for item in items if "gpu" in item.keywords and HERE in Path(str(item.path)).parents]
    if not gpu_items:
        return
    try:
        import torch

        if torch.cuda.is_available():
            return
    except ImportError:
        pass
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 model + local byte-level BPE tokenizer (HF format; nothing downloaded)."""
    maker = HERE.parent / "engine" / "make_tiny_model.py"
    spec = importlib.util.spec_from_file_location("make_tiny_model", maker)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("tiny-model")
    mod.main(str(out))
    return out
