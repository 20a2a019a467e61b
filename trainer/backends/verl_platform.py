"""verl on a machine without CUDA: a CPU platform for verl's device layer (verl ships CUDA and NPU
platforms only) and verl's FSDP engine registered for it, so the engine runs FSDP2 over gloo. That is
for tests and small checks, not for speed.

Importing this module installs the platform when torch sees no CUDA; it must be imported before any of
verl's engines (:mod:`~lgt.trainer.backends.verl_batch`, :mod:`~lgt.trainer.backends.verl_actor` and
:mod:`~lgt.trainer.backends.verl_ray` import it first, and each Ray rank imports it again). With CUDA it
does nothing: verl's own platform runs.
"""

from __future__ import annotations

import contextlib
import types
from functools import cache
from typing import Any

import torch

from lgt.trainer.backends.base import VERL_STRATEGIES


def install_cpu_platform() -> None:
    """Make verl's device layer answer "cpu" (gloo, no memory stats) when this machine has no CUDA."""
    from verl.plugin.platform import PlatformBase, platform_manager, set_platform

    if platform_manager._current_platform is not None:  # already chosen (e.g. by the caller)
        return

    def _zero(*_a: Any, **_k: Any) -> int:
        return 0

    def _nothing(*_a: Any, **_k: Any) -> None:
        return None

    cpu_module = types.SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, current_device=lambda: "cpu",
        device_count=lambda: 1, set_device=_nothing, synchronize=_nothing, empty_cache=_nothing,
        max_memory_allocated=_zero, max_memory_reserved=_zero, memory_allocated=_zero,
        memory_reserved=_zero, reset_peak_memory_stats=_nothing, mem_get_info=lambda *_a: (0, 0),
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
        get_rng_state=lambda *_a, **_k: torch.get_rng_state(),
        set_rng_state=lambda state, *_a, **_k: torch.set_rng_state(state),
        current_stream=torch.cpu.current_stream, Stream=torch.cpu.Stream, Event=torch.cpu.Event,
        stream=torch.cpu.stream, get_device_name=lambda *_a: "CPU",
    )

    class CpuPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = cpu_module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:  # a str, so `tensor.to(get_device_id())` stays on the CPU
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    set_platform(CpuPlatform())



@cache
def register_cpu_engine() -> None:
    """Let verl's FSDP engine run on the CPU platform (verl registers it for CUDA and NPU only); once."""
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    EngineRegistry.register(model_type="language_model", backend=list(VERL_STRATEGIES),
                            device=["cpu"])(FSDPEngineWithLMHead)


if not torch.cuda.is_available():
    install_cpu_platform()
