"""LoRA on the torch backend (``backend.lora``) with PEFT: the adapter put on a loaded model, its merged
weights, its PEFT folder, and a checkpoint merged into a full model (``lgt-train export --merge``).

The adapter goes on the linear layers whose last name is in ``target_modules`` (default: the attention
and MLP projections of :data:`~lgt.trainer.backends.base.DEFAULT_LORA_TARGETS` the model has); every
weight of the model is frozen, so only the adapter's A and B matrices reach AdamW. The adapter's folder
is PEFT's ``save_pretrained`` layout (``adapter_config.json`` + ``adapter_model.safetensors``), which
vLLM loads with ``--enable-lora`` (``POST /v1/load_lora_adapter``) and ``PeftModel.from_pretrained``
applies to the base.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from lgt.trainer.backends.base import BackendError, LoraConfig, lora_targets
from lgt.trainer.backends.checkpoints import ADAPTER_CONFIG

__all__ = ["ADAPTER_CONFIG", "apply", "load_weights", "merge", "merged_weights", "save", "target_modules"]

ADAPTER = "default"  # PEFT's name for the one adapter a model gets
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def targetable(model: torch.nn.Module) -> list[str]:
    """The last names of the model's linear layers an adapter can go on (the output head aside: it is
    the embedding's tensor in tied models, and a vocabulary-wide adapter is rarely what is meant)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head})


def target_modules(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """The module names the adapter goes on (:func:`~lgt.trainer.backends.base.lora_targets` on the
    model's linear layers): BackendError naming the ones it has for a target it lacks."""
    return lora_targets(cfg, targetable(model), type(model).__name__)


def peft_config(targets: list[str], cfg: LoraConfig, base_model: str | Path) -> object:
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                          bias="none", task_type="CAUSAL_LM", base_model_name_or_path=str(base_model))


def apply(model: torch.nn.Module, cfg: LoraConfig, base_model: str | Path) -> torch.nn.Module:
    """``model`` with a fresh adapter on ``target_modules`` (PEFT's ``PeftModel``; B starts at zero, so
    the policy starts as the base); every base weight frozen, the adapter's trainable."""
    from peft import get_peft_model

    return get_peft_model(model, peft_config(target_modules(model, cfg), cfg, base_model))


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(base model's parameter name, weight)`` for every parameter of the base (a tied tensor once),
    each adapted layer's weight with the adapter's update added (``W + alpha/r * B A``): the policy as
    one full model, without changing the live one."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    with torch.no_grad():
        adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
        for name, p in base.named_parameters():
            if ".lora_" in name:
                continue
            clean = name.replace(".base_layer.", ".")
            owner, _, leaf = clean.rpartition(".")
            layer = adapted.get(owner)
            if layer is not None and leaf == "weight" and ADAPTER in layer.lora_A:
                yield clean, p.detach() + layer.get_delta_weight(ADAPTER).to(p.dtype)
            else:
                yield clean, p.detach()


def save(model: torch.nn.Module, path: str | Path) -> Path:
    """The adapter as a PEFT folder at ``path`` (made; files replaced): ``adapter_config.json`` and
    ``adapter_model.safetensors``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    # PEFT writes a README.md model card beside them; the folder is the adapter and nothing else
    (path / "README.md").unlink(missing_ok=True)
    return path


def load_weights(model: torch.nn.Module, folder: Path) -> None:
    """The adapter saved in ``folder`` into ``model``'s (same targets and rank: BackendError otherwise)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(folder / ADAPTER_WEIGHTS), device=str(next(model.parameters()).device))
    try:
        result = set_peft_model_state_dict(model, state)
    except RuntimeError as e:  # a shape mismatch: another rank
        raise BackendError(f"the adapter in {folder} does not fit backend.lora (another rank or targets?): "
                           f"{str(e).splitlines()[0]}") from None
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in getattr(result, "missing_keys", []) or [] if ".lora_" in k]
    if unexpected or missing:
        raise BackendError(f"the adapter in {folder} does not fit backend.lora: it targets other modules "
                           f"({(unexpected or missing)[0]})")


def merge(adapter_dir: Path, base_dir: Path, out: Path) -> None:
    """The full model ``base_dir`` + the adapter in ``adapter_dir`` merged, saved as a Hugging Face model
    folder in ``out`` (which exists; the caller copies the tokenizer)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    merged = PeftModel.from_pretrained(base, adapter_dir, is_trainable=False).merge_and_unload()
    merged.save_pretrained(out)

