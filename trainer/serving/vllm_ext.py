"""A vLLM worker extension that reloads the policy's weights from a safetensors file, in place.

vLLM mixes ``WeightSyncExtension`` into its worker class when started with
``--worker-extension-cls lgt.trainer.serving.vllm_ext.WeightSyncExtension``; the trainer then calls
``POST /collective_rpc {"method": "lgt_load_weights", "args": [path]}`` (the dev endpoint, enabled by
``VLLM_SERVER_DEV_MODE=1``). Each worker reads the file (Hugging Face parameter names, any dtype) and
feeds it to vLLM's own ``reload_weights(weights_iterator=...)``, which runs the model's ``load_weights``
layer by layer and re-applies each layer's post-load processing (on CPU: re-packing the linear weights
for the GEMM kernels), copying the result into the existing tensors.

One thing that path misses: with tied embeddings the output head shares ``embed_tokens.weight`` but
receives no weights of its own, so on CPU its packed GEMM copy stays stale. ``_retie_lm_head`` points
it at the embedding again and re-runs its post-load processing (a no-op on GPU).

On the same machine without a file: ``lgt_load_weights_shm`` views the tensors the trainer copied once
into a POSIX shared-memory segment (no safetensors serialisation, no file). On a GPU, when the trainer
shares the engine's GPU, ``lgt_load_weights_ipc`` takes the weights without touching the host: the
trainer sends CUDA IPC handles of its tensors (``lgt.trainer.serving.weights.ipc_payload``), each worker opens
them on its own device and loads from the trainer's memory.

This module runs inside the vLLM worker process: it imports only torch and safetensors at import time.
The file is left in place; the caller deletes it once every worker has answered.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from a safetensors file one tensor at a time (CPU tensors)."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            yield name, f.get_tensor(name)


def _retie_lm_head(model: torch.nn.Module) -> bool:
    """Re-tie a tied output head to the input embedding and re-run its post-load processing.

    Returns True when the model has tied embeddings (and the head was re-tied).
    """
    config = getattr(model, "config", None)
    lm_head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if not (getattr(config, "tie_word_embeddings", False) and lm_head is not None and embed is not None):
        return False
    if not hasattr(lm_head, "weight") or not hasattr(embed, "weight"):
        return False
    if lm_head.weight is not embed.weight:
        lm_head.weight = embed.weight
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
        quant_method.process_weights_after_loading(lm_head)
    return True


IPC_DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device argument (torch.multiprocessing.reductions)


def open_ipc_payload(payload: str, device: int) -> list[tuple[str, torch.Tensor]]:
    """The tensors a trainer on the same GPU shared as CUDA IPC handles (``lgt.trainer.serving.engine.
    ipc_payload``): each rebuilt on this worker's ``device``, sharing the trainer's memory (no copy)."""
    import base64
    import pickle

    out = []
    for name, rebuild, args in pickle.loads(base64.b64decode(payload)):  # noqa: S301 - our own trainer
        args = list(args)
        args[IPC_DEVICE_ARG] = device  # this process may number the GPUs differently
        out.append((name, rebuild(*args)))
    return out


def open_shm_layout(name: str, layout: str) -> tuple[object, list[tuple[str, torch.Tensor]]]:
    """``(segment, tensors)``: the tensors a trainer on this machine packed into the POSIX shared-memory
    segment ``name`` (``lgt.trainer.serving.weights.shm_pack``), viewed in place. Close the segment when done
    (never unlink it: the trainer does)."""
    import json
    from multiprocessing import resource_tracker, shared_memory

    segment = shared_memory.SharedMemory(name=name)
    try:  # the trainer owns the segment: this process must not unlink it when it exits
        resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001
    except Exception:  # noqa: BLE001 - Python >= 3.13 does not track attached segments
        pass
    tensors = []
    for entry in json.loads(layout):
        dtype = getattr(torch, entry["dtype"])
        count = 1
        for d in entry["shape"]:
            count *= d
        flat = torch.frombuffer(segment.buf, dtype=dtype, count=count, offset=entry["offset"])
        tensors.append((entry["name"], flat.view(entry["shape"])))
    return segment, tensors


class WeightSyncExtension:
    """Methods vLLM adds to its worker (``self`` is the worker: ``self.model_runner``, ``reload_weights``).

    Names start with ``lgt_`` so they cannot clash with the worker's own attributes (vLLM asserts this).
    """

    def lgt_load_weights(self, path: str) -> dict:
        """Reload every weight found in the safetensors file ``path`` (HF names) into the served model.

        Returns ``{"tensors": n, "seconds": s, "tied": bool}``; raises if the file cannot be read or a
        name is unknown to the model (vLLM's loader raises then).
        """
        start = time.perf_counter()
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in iter_safetensors(path):
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        with torch.no_grad():
            tied = _retie_lm_head(self.model_runner.get_model())
        return {"tensors": count, "seconds": time.perf_counter() - start, "tied": tied}

    def lgt_load_weights_ipc(self, payload: str) -> dict:
        """Reload every weight shared by CUDA IPC in ``payload`` (HF names; from a trainer on the same
        GPU) into the served model, without touching disk. Returns like :meth:`lgt_load_weights`."""
        start = time.perf_counter()
        tensors = open_ipc_payload(payload, torch.cuda.current_device())
        self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        with torch.no_grad():
            tied = _retie_lm_head(self.model_runner.get_model())
        torch.cuda.synchronize()
        return {"tensors": len(tensors), "seconds": time.perf_counter() - start, "tied": tied}

    def lgt_load_weights_shm(self, name: str, layout: str) -> dict:
        """Reload every weight packed into the shared-memory segment ``name`` (``layout``: JSON list of
        name, dtype, shape, byte offset) into the served model: no file, no serialisation. Returns like
        :meth:`lgt_load_weights`."""
        start = time.perf_counter()
        segment, tensors = open_shm_layout(name, layout)
        try:
            self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
            with torch.no_grad():
                tied = _retie_lm_head(self.model_runner.get_model())
        finally:
            del tensors
            segment.close()
        return {"tensors": len(json.loads(layout)), "seconds": time.perf_counter() - start, "tied": tied}
