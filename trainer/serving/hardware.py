"""Which floating-point type this machine computes fastest in: ``dtype: auto`` for the engine and the
torch backend.

``auto`` means bfloat16 where the hardware does bf16 arithmetic natively and float32 elsewhere:

* a CPU with ``avx512_bf16`` or ``amx_bf16`` among its ``/proc/cpuinfo`` flags (Intel Cooper Lake and
  Sapphire Rapids on, AMD Zen 4 on) — elsewhere torch and vLLM's CPU build *emulate* bf16 through
  float32, which is slower than float32 itself;
* a CUDA GPU for which ``torch.cuda.is_bf16_supported()`` holds (Ampere on).

No other CPU (ARM's ``bf16`` feature included) is taken for native: unmeasured, so float32. The
functions take the cpuinfo text as an argument (tests give their own); ``None`` reads this machine's.
Each answer comes with one clause saying why, for the run's log line.
"""

from __future__ import annotations

from pathlib import Path

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU feature flags named on the ``flags`` lines of ``cpuinfo`` (``None``: this machine's
    ``/proc/cpuinfo``, empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return set()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags.update(value.split())
    return flags


def bf16_native(device: str = "cpu", *, cpuinfo: str | None = None) -> tuple[bool, str]:
    """``(native, why)``: whether ``device`` (``cpu``, ``cuda`` or ``cuda:N``) computes in bfloat16
    natively, and a clause saying what decided it."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA device is visible"
        name = torch.cuda.get_device_name(torch.device(device))
        if torch.cuda.is_bf16_supported():
            return True, f"{name} supports bf16"
        return False, f"{name} does not support bf16"
    have = sorted(cpu_flags(cpuinfo) & set(BF16_CPU_FLAGS))
    if have:
        return True, f"this CPU has {' and '.join(have)}"
    return False, (f"this CPU has neither {' nor '.join(BF16_CPU_FLAGS)}, so bf16 would be emulated, slower "
                   "than float32")


def resolve_dtype(requested: str, device: str = "cpu", *, key: str = "dtype",
                  cpuinfo: str | None = None) -> tuple[str, str]:
    """``(dtype, why)``: ``requested`` itself, or for ``auto`` bfloat16 where ``device`` does bf16
    natively and float32 elsewhere. ``key`` names the setting in ``why`` (e.g. ``backend.dtype``)."""
    if requested != "auto":
        return requested, f"{key} {requested}"
    native, why = bf16_native(device, cpuinfo=cpuinfo)
    return ("bfloat16" if native else "float32"), f"{key} auto: {why}"
