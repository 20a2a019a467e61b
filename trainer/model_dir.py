"""Model directories: check that one holds a usable Hugging Face causal language model, without
loading it; and its chat template.

``check_model_dir`` reads only the small JSON files (``config.json``, ``tokenizer_config.json``,
``generation_config.json``) and looks for the tokenizer's files; no weights are read and nothing is
downloaded. A directory that would fail later (in vLLM, in the trainer) fails here in one sentence.

Chat templates (:func:`check_chat_template`): an agent's tools, its model's tool calls and the tools'
results must survive rendering, and a later prompt must extend an earlier one. lgt ships a ChatML
template with tools (:data:`CHATML_TOOLS`) for models whose own has none; :func:`with_chat_template`
gives any model directory another template for every reader of the folder at once.

How a model is made (``model.make``, ``lgt-train make-model``) is :mod:`lgt.trainer.make_model`'s; an
import from GGUF, :mod:`lgt.trainer.gguf`'s.
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


def read_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; ModelError if it is not valid JSON or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path} is not a readable {what} ({e.__class__.__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path} is not a {what}: it holds a JSON {type(data).__name__}, not an object")
    return data


def linear_layer_names(path: str | Path, vocab_size: int | None = None) -> list[str] | None:
    """The last names of the modules whose 2-D ``<module>.weight`` the model's safetensors files hold —
    its linear layers (``q_proj``, ``down_proj`` …) — read from the files' headers, without torch;
    tensors of ``vocab_size`` rows (the embedding, an untied output head) left out. None when the folder
    has no readable safetensors file (another format: the caller cannot tell)."""
    names: set[str] = set()
    files = sorted(Path(path).glob("*.safetensors"))
    for f in files:
        try:
            with f.open("rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size)) if 0 < size < 2**28 else None
        except (OSError, ValueError):
            return None
        if not isinstance(header, dict):
            return None
        for key, meta in header.items():
            shape = meta.get("shape") if isinstance(meta, dict) else None
            matrix = isinstance(shape, list) and len(shape) == 2 and shape[0] != vocab_size
            if key.endswith(".weight") and matrix:
                names.add(key.removesuffix(".weight").rsplit(".", 1)[-1])
    return sorted(names) if files else None


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
    config = read_json(config_path, "model config (config.json)")

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
    tok_config = read_json(tok_config_path, "tokenizer config") if tok_config_path.is_file() else {}
    has_template = _has_chat_template(path, tok_config)
    if need_chat_template and not has_template:
        raise ModelError(f"{path} has no chat template: lgt needs one to turn the agent's messages into "
                         "tokens (add chat_template to tokenizer_config.json)")

    eos = _as_ids(text.get("eos_token_id", config.get("eos_token_id")))
    gen_path = path / "generation_config.json"
    if not eos and gen_path.is_file():
        eos = _as_ids(read_json(gen_path, "generation config").get("eos_token_id"))
    return ModelInfo(path=path, architecture=architecture, model_type=model_type, vocab_size=vocab_size,
                     max_position_embeddings=max_pos if isinstance(max_pos, int) else None,
                     tie_word_embeddings=bool(tie), has_chat_template=has_template,
                     eos_token_id=eos[0] if eos else None, eos_token_ids=eos,
                     rope_scaled=rope_type not in ("default", None))


# --- chat templates ---------------------------------------------------------------------------------

TEMPLATES = Path(__file__).resolve().parent / "templates"
CHATML_TOOLS = TEMPLATES / "chatml_tools.jinja"  # ChatML with tools, hermes tool calls (SmolLM2's)
# What check_chat_template renders: a tool, a call of it and its result, each with a value to look for.
_PROBE_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
_PROBE_ARGS = {"city": "Reykjavik"}
_PROBE_RESULT = "light rain, 7 degrees"


def special_tokens(model_dir: Path | None) -> dict[str, str]:
    """The special tokens a template may name (``bos_token``, ``eos_token`` …) from ``model_dir``'s
    tokenizer_config.json, as transformers' apply_chat_template passes them; {} without one."""
    path = model_dir / "tokenizer_config.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return {}
    config = read_json(path, "tokenizer config")
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = config.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[key] = v
    return out


def read_chat_template(path: str | Path) -> str:
    """The text of a chat template file (Jinja); ModelError when it cannot be read or is empty."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelError(f"chat template {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"chat template {path} cannot be read ({e.__class__.__name__}: {e})") from None
    if not text.strip():
        raise ModelError(f"chat template {path} is empty")
    return text


def check_chat_template(template: str, *, name: str = "the chat template",
                        special_tokens: dict[str, str] | None = None) -> None:
    """ModelError (one sentence naming ``name`` and the cause) unless ``template`` renders what an agent
    with tools needs, as transformers (and so vLLM) render it: the tools listed in the prompt, an
    assistant's tool call (its name and arguments, given as the JSON string of the OpenAI wire format
    and as the object vLLM passes), the tool's result, and prompts that extend each other — the prompt
    for the first reply is a prefix of the prompt after the tool call and its result, which is a prefix
    of the one after the next exchange (else the recorded calls cannot merge into one sample)."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = [_PROBE_TOOL]
    tool_name = _PROBE_TOOL["function"]["name"]

    def call(arguments: Any) -> dict[str, Any]:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": tool_name, "arguments": arguments}}]}

    system = {"role": "system", "content": "You answer questions about the weather."}
    user = {"role": "user", "content": "What is the weather in Reykjavik?"}
    result = {"role": "tool", "tool_call_id": "call_1", "name": tool_name, "content": _PROBE_RESULT}
    after = [{"role": "assistant", "content": "It rains in Reykjavik."},
             {"role": "user", "content": "Thanks."}]

    def render(messages: list[dict[str, Any]], what: str) -> str:
        try:
            out, _ = render_jinja_template([messages], tools=tools, chat_template=template,
                                           add_generation_prompt=True, **(special_tokens or {}))
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise ModelError(f"{name} cannot render {what} ({e.__class__.__name__}: {first})") from None
        return out[0]

    first = render([system, user], "a prompt with tools")
    if tool_name not in first:
        raise ModelError(f"{name} does not list the agent's tools: the prompt for a request with a tool "
                         f"{tool_name!r} does not name it")
    for form, arguments in (("as a JSON string", json.dumps(_PROBE_ARGS)), ("as an object", _PROBE_ARGS)):
        turn = render([system, user, call(arguments)], f"an assistant's tool call (arguments {form})")
        if not turn.startswith(first):
            raise ModelError(f"{name} makes a later prompt not extend the earlier one: with the assistant's "
                             f"tool call added, the prompt differs from the first at character "
                             f"{_differs_at(first, turn)}, so recorded calls cannot merge into one sample")
        reply = turn[len(first):]
        if tool_name not in reply or _PROBE_ARGS["city"] not in reply:
            raise ModelError(f"{name} cannot render a tool call: an assistant message whose tool_calls call "
                             f"{tool_name}(city={_PROBE_ARGS['city']!r}) (arguments {form}) renders "
                             "without the call's name or arguments")
    second = render([system, user, call(json.dumps(_PROBE_ARGS)), result], "a tool result")
    if not second.startswith(first):
        raise ModelError(f"{name} makes a later prompt not extend the earlier one: the prompt after a tool "
                         f"call and its result differs from the first prompt at character "
                         f"{_differs_at(first, second)}, so recorded calls cannot merge into one sample")
    if _PROBE_RESULT not in second[len(first):]:
        raise ModelError(f"{name} cannot render a tool result: a role tool message's content does not appear "
                         "in the prompt")
    third = render([system, user, call(json.dumps(_PROBE_ARGS)), result, *after], "a second exchange")
    if not third.startswith(second):
        raise ModelError(f"{name} makes a later prompt not extend the earlier one: the prompt after one more "
                         f"exchange differs from the one before at character {_differs_at(second, third)}, "
                         "so recorded calls cannot merge into one sample")


def _differs_at(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# Files that hold a model directory's chat template (transformers reads chat_template.jinja first, then
# tokenizer_config.json's chat_template; additional_chat_templates/ holds named ones, e.g. tool_use).
TEMPLATE_ENTRIES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")


def with_chat_template(model_dir: str | Path, template: str, dest: str | Path) -> Path:
    """``dest``: ``model_dir`` with ``template`` as its chat template, for every reader of the folder at
    once (vLLM, transformers' apply_chat_template, a checkpoint copying the tokenizer files). Its entries
    are symbolic links to ``model_dir``'s, except the template files (left out) and
    ``tokenizer_config.json``, written with ``chat_template`` set; ``chat_template.jinja`` holds the
    template too. Built beside ``dest`` and renamed into place (an older ``dest`` is replaced); returns
    ``dest``. The weights are not copied."""
    from lgt.store.files import atomic_dir

    model_dir, dest = Path(model_dir).resolve(), Path(dest)
    with atomic_dir(dest) as tmp:
        for entry in sorted(model_dir.iterdir()):
            if entry.name not in (*TEMPLATE_ENTRIES, "tokenizer_config.json"):
                (tmp / entry.name).symlink_to(entry)
        tok_config_path = model_dir / "tokenizer_config.json"
        tok_config = read_json(tok_config_path, "tokenizer config") if tok_config_path.is_file() else {}
        tok_config["chat_template"] = template
        text = json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n"
        (tmp / "tokenizer_config.json").write_text(text, encoding="utf-8")
        (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
    return dest
