"""How new weights reach the vLLM workers without a restart (``Engine.update_weights``): the tensors
collected and checked against the served checkpoint, then handed over one of three ways, each a method
of the worker extension (``lgt.trainer.serving.vllm_ext``).

``file``: written atomically as one safetensors file (under /dev/shm when it exists), which the workers
read and which is deleted once they answered. ``shm`` (the default on CPU): copied once into a
shared-memory segment the workers view in place. ``ipc``: on a GPU, with the trainer's tensors on the
engine's GPU, nothing touches the host: the workers receive CUDA IPC handles and load straight from the
trainer's memory.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from lgt.store.files import atomic_path
from lgt.trainer.serving.launch import EngineError

LOAD_METHOD = "lgt_load_weights"
# how new weights reach the workers (Engine.update_weights): the worker extension's method for each
LOAD_METHODS = {"file": LOAD_METHOD, "shm": "lgt_load_weights_shm", "ipc": "lgt_load_weights_ipc"}
TRANSPORTS = ("auto", *LOAD_METHODS)


@dataclass(frozen=True)
class SyncTimings:
    """Seconds spent in one ``update_weights``: write (gathering the tensors on CPU, checking them, writing
    the file), pause, load (in the workers, reading the file included), reset (prefix cache), resume; total
    is the wall time of all. tensors and nbytes describe the file."""

    write: float
    pause: float
    load: float
    reset: float
    resume: float
    total: float
    tensors: int
    nbytes: int


def weights_dir() -> Path:
    """Where weight files for a sync go: /dev/shm (RAM) when it exists and is writable, else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def collect_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], *, to_cpu: bool = True
                    ) -> dict[str, torch.Tensor]:
    """``named_tensors`` as a dict of detached, contiguous tensors (on the CPU unless ``to_cpu`` is
    False), each with its own storage.

    Tensors sharing storage (tied weights) are copied so each name gets its own (safetensors needs that).
    Raises EngineError for no tensors or a name given twice.
    """
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in named_tensors:
        if name in tensors:
            raise EngineError(f"weight {name!r} is given twice: pass each parameter once")
        t = (tensor.detach().to("cpu") if to_cpu else tensor.detach()).contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    if not tensors:
        raise EngineError("no weights were given to update the engine with")
    return tensors


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the model directory's safetensors files (headers only; {} if none)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise EngineError(f"{path} is not a readable safetensors file ({e})") from e
    return shapes


def checkpoint_tensors(model_dir: Path) -> Iterable[tuple[str, torch.Tensor]]:
    """Every tensor of the model directory's safetensors files, by name (what an attached engine is
    given to serve that checkpoint without a restart)."""
    from lgt.trainer.serving.vllm_ext import iter_safetensors

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        yield from iter_safetensors(path)


def check_weights(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]],
                  *, tied: bool) -> None:
    """Raise EngineError unless ``tensors`` holds every checkpoint weight of ``expected`` with its shape.

    A partial or misnamed update would leave vLLM's model half-loaded, so it is refused before anything
    is sent. With tied embeddings an extra ``lm_head.weight`` (what ``state_dict()`` holds) is accepted.
    Nothing is checked when ``expected`` is empty (a checkpoint without safetensors files).
    """
    if not expected:
        return
    allowed_extra = {"lm_head.weight"} if tied else set()
    unknown = sorted(set(tensors) - set(expected) - allowed_extra)
    if unknown:
        raise EngineError(f"{len(unknown)} of the weights given are not in the served model's checkpoint "
                          f"(first: {unknown[0]!r}): pass the model's own parameter names")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise EngineError(f"{len(missing)} of the served model's weights are missing from the update "
                          f"(first: {missing[0]!r}): pass every parameter (a full state dict)")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            got = tuple(tensors[name].shape)
            raise EngineError(f"weight {name!r} has shape {got} but the served model's is {shape}")


def ipc_payload(tensors: Mapping[str, torch.Tensor]) -> str:
    """CUDA IPC handles of ``tensors`` (on a GPU) as one string for ``/collective_rpc``: the vLLM workers
    open them in place (``lgt.trainer.serving.vllm_ext.open_ipc_payload``); the tensors must stay alive until
    the workers answered."""
    import base64
    import pickle

    from torch.multiprocessing.reductions import reduce_tensor

    items = []
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise EngineError(f"weight {name!r} is on {t.device}: CUDA IPC shares GPU tensors only")
        rebuild, args = reduce_tensor(t)
        items.append((name, rebuild, args))
    return base64.b64encode(pickle.dumps(items)).decode()


def shm_pack(tensors: Mapping[str, torch.Tensor]) -> tuple[Any, str, int]:
    """``(segment, layout JSON, bytes)``: ``tensors`` (CPU) copied once into a new POSIX shared-memory
    segment, each at a 64-byte aligned offset, for the workers to view in place
    (``lgt.trainer.serving.vllm_ext.open_shm_layout``). The caller closes and unlinks the segment."""
    import json
    from multiprocessing import shared_memory

    import torch

    layout, offset = [], 0
    for name, t in tensors.items():
        layout.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                       "offset": offset})
        offset += -(-t.numel() * t.element_size() // 64) * 64
    segment = shared_memory.SharedMemory(create=True, size=max(offset, 1))
    try:
        for entry, t in zip(layout, tensors.values()):
            n = t.numel() * t.element_size()
            dest = torch.frombuffer(segment.buf, dtype=torch.uint8, count=n, offset=entry["offset"])
            dest.copy_(t.reshape(-1).view(torch.uint8))
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    return segment, json.dumps(layout), sum(t.numel() * t.element_size() for t in tensors.values())


def write_weights(tensors: Mapping[str, torch.Tensor], directory: Path) -> tuple[Path, int]:
    """Write ``tensors`` (from ``collect_tensors``) as one safetensors file in ``directory``, atomically
    (temp file + rename). Returns (path, bytes of tensor data)."""
    from safetensors.torch import save_file

    final = Path(directory) / f"lgt-weights-{secrets.token_hex(8)}.safetensors"
    with atomic_path(final) as tmp:
        save_file(dict(tensors), str(tmp), metadata={"format": "pt"})
    return final, sum(t.numel() * t.element_size() for t in tensors.values())
