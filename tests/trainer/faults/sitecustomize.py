"""A fault injected from the test side into an ``lgt-train`` subprocess: no test switch in the product.

A test puts this folder first on the subprocess's ``PYTHONPATH``, so Python imports this module at
start-up in every process of the run. With ``LGT_TEST_KILL_AT_TRAIN_STEP=N`` set (read here only),
``lgt.trainer.backends.torch_backend`` is patched as soon as it is imported: the ``N``-th call of
``TorchBackend.train_step`` in that process kills it with SIGKILL — inside a training step, with the proxy
paused, before the step's update, checkpoint or metrics row; a crash nothing can clean up after. The other
processes (the engine, the proxy, the agents) never import that module and are left as they were.
"""

from __future__ import annotations

import os
from typing import Any

TARGET = "lgt.trainer.backends.torch_backend"


def _patch(module: Any) -> None:
    import signal

    n = int(os.environ["LGT_TEST_KILL_AT_TRAIN_STEP"])
    cls = module.TorchBackend
    original = cls.train_step
    calls = 0

    def train_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    cls.train_step = train_step


def _install() -> None:
    import importlib.abc
    import importlib.util
    import sys

    class PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != TARGET:
                return None
            sys.meta_path.remove(self)  # the module's own finder finds it; this one has done its work
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_then_patch(module: Any) -> None:
                exec_module(module)
                _patch(module)

            spec.loader.exec_module = exec_then_patch
            return spec

    sys.meta_path.insert(0, PatchOnImport())


if os.environ.get("LGT_TEST_KILL_AT_TRAIN_STEP"):
    _install()
