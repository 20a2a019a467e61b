"""The demo models: a randomly initialised ``Qwen2ForCausalLM`` in one of a few sizes (head_dim 64: vLLM's
CPU attention needs it), saved with its tokenizer in Hugging Face format."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lgt.trainer.demo.chat import ENDOFTEXT, IM_END
from lgt.trainer.demo.tasks import TinyModelError
from lgt.trainer.demo.tokenizer import MAX_POSITIONS, build_tokenizer, load_tokenizer

# Model sizes. head_dim (hidden / heads) is 64 in all of them: vLLM's CPU attention rejects small heads.
PRESETS: dict[str, dict[str, int]] = {
    # ~200k parameters: fast tests (too small to learn the tasks)
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1),
    # ~1.4M parameters: learns the arith task on CPU in about a minute (hidden 128 did not)
    "demo": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4),
    # ~10M parameters: benchmarks
    "10m": dict(hidden_size=384, intermediate_size=1152, num_hidden_layers=6, num_attention_heads=6,
                num_key_value_heads=2),
    # Qwen2-0.5B's shape (with lgt's small vocabulary: ~0.36B parameters): the GPU check
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
}


def _model_config(preset: str, tokenizer) -> Any:
    from transformers import Qwen2Config

    if preset not in PRESETS:
        raise TinyModelError(f"preset {preset!r} is not one of {', '.join(PRESETS)}")
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    return Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=MAX_POSITIONS,
                       tie_word_embeddings=True, eos_token_id=eos, bos_token_id=pad, pad_token_id=pad,
                       **PRESETS[preset])


def build_model(out_dir: str | Path, *, preset: str = "tiny", seed: int = 0) -> Path:
    """Save a randomly initialised Qwen2ForCausalLM (float32, tied embeddings) into ``out_dir``.

    Builds the tokenizer first when ``out_dir`` has none. ``generation_config.json`` names ``<|im_end|>``
    as eos and sets no sampling defaults (vLLM would take them as the request defaults). Returns out_dir.
    """
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    out = Path(out_dir)
    if preset not in PRESETS:
        raise TinyModelError(f"preset {preset!r} is not one of {', '.join(PRESETS)}")
    if not (out / "tokenizer.json").is_file():
        build_tokenizer(out)
    tokenizer = load_tokenizer(out)
    config = _model_config(preset, tokenizer)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id,
                                               bos_token_id=config.bos_token_id)
    model.save_pretrained(out)
    return out


def count_parameters(model_dir: str | Path) -> int:
    """Number of distinct parameters of the saved model (tied embeddings counted once)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            total += math.prod(f.get_slice(name).get_shape())
    return total
