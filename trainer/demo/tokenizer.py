"""The demo models' tokenizer: a byte-level BPE trained on the tasks' text (nothing is downloaded), with
the chat template of :mod:`lgt.trainer.demo.chat`."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from lgt.trainer.demo.chat import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    SPECIAL_TOKENS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    tool_call_text,
)
from lgt.trainer.demo.tasks import CALC_TOOL, arith_tasks, calc_error, calc_tasks, calculate

# RoPE needs no weights per position, so a wide range costs nothing; and it must cover every position
# an agent can reach. vLLM's CPU build reads past its RoPE cache beyond max_position_embeddings: from
# there its logits are garbage (11 nats off transformers on the demo model) and then NaN, so a logprob
# the server cannot write as JSON (400 "Out of range float values"). Agent frameworks send prompts of
# several thousand tokens; 1024 was too short.
MAX_POSITIONS = 32768


def _corpus(seed: int = 0) -> list[str]:
    """Text like what the tasks' dialogues hold (rendered by hand: no tokenizer exists yet)."""
    rng = random.Random(seed)
    tool_line = json.dumps({"name": "calculator", "description": CALC_TOOL["function"]["description"],
                            "parameters": CALC_TOOL["function"]["parameters"]})
    system = (f"# Tools\n<tools>\n{tool_line}\n</tools>\nTo call a tool, reply <tool_call>\n"
              '{"name": <name>, "arguments": <object>}\n</tool_call>')
    texts = []
    for task in arith_tasks(200):
        texts += [f"user\n{task['question']}", f"assistant\nThe answer is {task['answer']}."]
    for task in calc_tasks(300, seed=seed):
        expr = task["expression"] if rng.random() < 0.5 else calc_error(task["expression"])
        texts += [system, f"user\n{task['question']}",
                  f"assistant\n{tool_call_text('calculator', {'expression': expr})}",
                  f"tool\n{calculate(expr)}", f"assistant\nThe answer is {calculate(expr)}."]
    texts += ["system\nYou are a helpful assistant.", "user\nHello! Who are you?",
              "assistant\nI am a small model that does arithmetic."]
    return texts


def build_tokenizer(out_dir: str | Path, *, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE tokenizer on the tasks' text and save it (HF format) into ``out_dir``.

    Digits are split one per token (like Qwen2), so numbers are read and copied digit by digit. Special
    tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos); added (non-special, so they
    survive decoding) ``<tool_call>`` and ``</tool_call>``. The chat template is CHAT_TEMPLATE.
    Returns ``out_dir``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (TOOL_CALL_START, TOOL_CALL_END)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                   model_max_length=MAX_POSITIONS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out


def load_tokenizer(model_dir: str | Path):
    """The HF tokenizer saved in ``model_dir`` (local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def encode(tokenizer, text: str) -> list[int]:
    """``text``'s token ids, no special tokens added."""
    return tokenizer.encode(text, add_special_tokens=False)


def render(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt the chat template makes of ``messages`` (and ``tools``), ending where the reply begins."""
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
