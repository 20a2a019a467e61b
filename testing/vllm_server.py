"""A plain vLLM OpenAI server for tests (``vllm_server``): started as a test wants it (no lgt worker
extension, dev endpoints or plugin settings: what an agent's own vLLM would be) and waited for exactly as
``lgt-train`` waits for its engine — ``Engine.wait_ready`` (``/health`` and ``/v1/models`` answer 200;
an engine that exits or is not ready in time raises ``EngineError`` with its log's last lines) — then
stopped as lgt stops one (``Engine.stop``: the whole process group, SIGTERM, then SIGKILL).

Works from the proxy's environment too: vLLM runs in ``python`` (e.g. the trainer's ``.venv``), and
nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from lgt.testing.proxy import ENV_VARS
from lgt.trainer.serving.children import free_port
from lgt.trainer.serving.engine import Engine
from lgt.trainer.serving.launch import EngineConfig


@contextlib.contextmanager
def vllm_server(model: Path, log_path: Path, *extra_args: str, python: str | None = None,
                max_model_len: int = 512, timeout: float = 300.0) -> Iterator[Engine]:
    """vLLM's OpenAI server for ``model`` (served as ``policy``, float32, eager, on loopback), ready; its
    ``Engine`` handle (``.url`` is the /v1 base URL). Stopped when the block ends."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS and "proxy" not in k.lower()}  # loopback
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "policy", "--enforce-eager", "--dtype", "float32",
           "--max-model-len", str(max_model_len), *extra_args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    engine = Engine(EngineConfig(model=model, port=port, max_model_len=max_model_len, log_path=log_path),
                    proc, port, log_path, cpu=True, weight_shapes={}, tied=False)
    try:
        engine.wait_ready(timeout)  # the product's own wait for its engine
        yield engine
    finally:
        engine.stop()
