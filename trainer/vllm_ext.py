"""A vLLM worker extension that reloads the policy's weights from a safetensors file, in place.

vLLM mixes ``WeightSyncExtension`` into its worker class when started with
``--worker-extension-cls lgt.trainer.vllm_ext.WeightSyncExtension``; the trainer then calls
``POST /collective_rpc {"method": "lgt_load_weights", "args": [path]}`` (the dev endpoint, enabled by
``VLLM_SERVER_DEV_MODE=1``). Each worker reads the file (Hugging Face parameter names, any dtype) and
feeds it to vLLM's own ``reload_weights(weights_iterator=...)``, which runs the model's ``load_weights``
layer by layer and re-applies each layer's post-load processing (on CPU: re-packing the linear weights
for the GEMM kernels), copying the result into the existing tensors.

One thing that path misses: with tied embeddings the output head shares ``embed_tokens.weight`` but
receives no weights of its own, so on CPU its packed GEMM copy stays stale. ``_retie_lm_head`` points
it at the embedding again and re-runs its post-load processing (a no-op on GPU).

This module runs inside the vLLM worker process: it imports only torch and safetensors at import time.
The file is left in place; the caller deletes it once every worker has answered.
"""

from __future__ import annotations

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
