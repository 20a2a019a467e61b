"""Fixtures for the verl backend's tests (run in verl's environment, ``.venv-verl``)."""

from __future__ import annotations

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
    from lgt.testing.random_model import make_test_model

    return make_test_model(tmp_path_factory.mktemp("tiny-model"))
