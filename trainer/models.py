"""Check that a directory holds a usable Hugging Face causal language model, without loading it.

``check_model_dir`` reads only the small JSON files (``config.json``, ``tokenizer_config.json``,
``generation_config.json``) and looks for the tokenizer's files; no weights are read and nothing is
downloaded. A directory that would fail later (in vLLM, in the trainer) fails here in one sentence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Files from which a tokenizer can be built (fast tokenizer, BPE vocab + merges, sentencepiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "tiktoken.model", "vocab.txt")
# Where transformers keeps a chat template besides tokenizer_config.json (newer versions write these).
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class MakeModel:
    """Build a model locally when its path does not exist yet (lgt.trainer.demo.tiny.make_model): the run
    config's ``model.make``, and ``teacher.make`` (a stronger teacher the example makes itself, e.g. the
    same warm start trained longer on right answers: ``correct_fraction: 0.95``)."""

    preset: str = "demo"
    warm_start: str | None = "arith"  # arith | carry | calc | both | null
    seconds: float = 90.0  # CPU-seconds of warm start (as many steps as this machine makes in them) ...
    steps: int | None = None  # ... or this many steps, the same model on every machine (seconds ignored)
    seed: int = 0
    correct_fraction: float = 0.4  # the warm start's share of right answers (the rest a fixed error)

    def __post_init__(self) -> None:
        if isinstance(self.correct_fraction, bool) or not 0.0 <= self.correct_fraction <= 1.0:
            raise ValueError(f"correct_fraction must be between 0 and 1, not {self.correct_fraction!r}")


class ModelError(ValueError):
    """A model directory that cannot serve as a policy; the message is one sentence naming the problem."""


@dataclass(frozen=True)
class ModelInfo:
    """What the trainer and the engine need to know about a model directory (read from its JSON files).

    ``eos_token_id`` is the first end-of-sequence id (``config.json``, else ``generation_config.json``);
    ``eos_token_ids`` holds all of them (a model may stop on several).
    """

    path: Path
    architecture: str
    model_type: str
    vocab_size: int
    max_position_embeddings: int | None
    tie_word_embeddings: bool
    has_chat_template: bool
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaled: bool = False  # RoPE scaling (YaRN, linear...) stretches the trained positions

    def check_context(self, max_model_len: int | None) -> None:
        """ModelError when ``max_model_len`` reaches past the positions the model has: vLLM's CPU build
        reads past its RoPE cache there (garbage logits, then NaN logprobs it cannot answer with)."""
        limit = self.max_position_embeddings
        if max_model_len is not None and limit is not None and not self.rope_scaled and max_model_len > limit:
            raise ModelError(f"max_model_len {max_model_len} exceeds {self.path}'s max_position_embeddings "
                             f"{limit}: positions past it are not computed correctly; lower max_model_len")


def _read_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; ModelError if it is not valid JSON or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path} is not a readable {what} ({e.__class__.__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path} is not a {what}: it holds a JSON {type(data).__name__}, not an object")
    return data


def _as_ids(value: Any) -> tuple[int, ...]:
    """An eos_token_id field (int, list of ints or null) as a tuple of ints."""
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def _causal_lm_class(model_type: str) -> str | None:
    """The class AutoModelForCausalLM builds for ``model_type``, or None (imports transformers: slow path)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a config that describes the language model (multimodal configs nest it)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def _has_chat_template(path: Path, tok_config: dict[str, Any]) -> bool:
    if tok_config.get("chat_template"):
        return True
    return any((path / name).is_file() and (path / name).stat().st_size > 0 for name in CHAT_TEMPLATE_FILES)


def check_model_dir(path: str | Path, *, need_chat_template: bool = False) -> ModelInfo:
    """Check that ``path`` holds a causal LM with a tokenizer; return what its JSON files say.

    Raises ModelError (one sentence) when the directory is missing, has no (valid) config.json, is not a
    causal language model, has no tokenizer, or (with ``need_chat_template``) has no chat template.
    Fast: reads JSON only (transformers is imported only for architectures not named ``*ForCausalLM``).
    """
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path} does not exist: give a directory holding a Hugging Face model")
    if not path.is_dir():
        raise ModelError(f"{path} is not a directory: give a directory holding a Hugging Face model")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelError(f"{path} has no config.json: it is not a Hugging Face model directory")
    config = _read_json(config_path, "model config (config.json)")

    architectures = config.get("architectures") or []
    model_type = str(config.get("model_type") or "")
    architecture = str(architectures[0]) if architectures else ""
    # Other causal LMs (GPT2LMHeadModel, or a config naming only its model_type) pass if transformers'
    # AutoModelForCausalLM maps their model type; that check imports transformers, so it comes last.
    if not architecture.endswith("ForCausalLM"):
        mapped = None
        if model_type and (architecture.endswith("LMHeadModel") or not architecture):
            mapped = _causal_lm_class(model_type)
        if mapped is None:
            named = architecture or "no architecture"
            raise ModelError(f"{path} is not a causal language model: its config.json names {named} "
                             "(need an architecture ending in ForCausalLM)")
        architecture = architecture or mapped

    text = _text_config(config)
    vocab_size = text.get("vocab_size", config.get("vocab_size"))
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ModelError(f"{path}/config.json has no positive vocab_size: the model's config is incomplete")
    max_pos = text.get("max_position_embeddings", config.get("max_position_embeddings"))
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"

    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(f"{path} has no tokenizer: lgt needs tokenizer.json (or vocab/merges files) next "
                         "to config.json (save the tokenizer with save_pretrained into the same directory)")
    tok_config_path = path / "tokenizer_config.json"
    tok_config = _read_json(tok_config_path, "tokenizer config") if tok_config_path.is_file() else {}
    has_template = _has_chat_template(path, tok_config)
    if need_chat_template and not has_template:
        raise ModelError(f"{path} has no chat template: lgt needs one to turn the agent's messages into "
                         "tokens (add chat_template to tokenizer_config.json)")

    eos = _as_ids(text.get("eos_token_id", config.get("eos_token_id")))
    gen_path = path / "generation_config.json"
    if not eos and gen_path.is_file():
        eos = _as_ids(_read_json(gen_path, "generation config").get("eos_token_id"))
    return ModelInfo(path=path, architecture=architecture, model_type=model_type, vocab_size=vocab_size,
                     max_position_embeddings=max_pos if isinstance(max_pos, int) else None,
                     tie_word_embeddings=bool(tie), has_chat_template=has_template,
                     eos_token_id=eos[0] if eos else None, eos_token_ids=eos,
                     rope_scaled=rope_type not in ("default", None))
