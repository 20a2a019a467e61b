"""The tests' tiny model: a random Qwen2 (hidden 128, 2 layers, head_dim 64) with a byte-level BPE
tokenizer of ~400 tokens trained here and a plain ChatML template; nothing is downloaded.

For tests and benchmarks that need a real model (the torch and verl backends, a real vLLM engine):
``make_test_model(OUT_DIR)``, or ``python -m lgt.testing.random_model OUT_DIR [--nan-logits]`` from an
environment that has torch, transformers and tokenizers (the proxy's environment runs it that way).

It is not ``lgt.trainer.demo``'s ``tiny`` preset (the same shape) because the tests lean on two
things that factory does not offer: weights drawn with ``initializer_range`` 0.5, whose peaked logits
keep greedy decoding off near-ties (two identical requests must decode alike whatever the batch), and
``nan_logits``: the final norm's weight set to infinity, so every logit is NaN and vLLM cannot write a
logprob as JSON: it answers 400 to any request for logprobs (what it does past a model's positions on
CPU, where the failure depends on memory layout; this one is deterministic).
"""

from __future__ import annotations

import sys
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_test_model(out: str | Path, nan_logits: bool = False) -> Path:
    """Save the tiny model and its tokenizer (Hugging Face format) into ``out``; returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"What is {a}+{b}? The answer is {a + b}."
                             for a in range(10) for b in range(10)] * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(out))
    # head_dim 64: vLLM's CPU attention rejects small head sizes (16 fails at the first request)
    cfg = Qwen2Config(vocab_size=len(fast), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id,
                      pad_token_id=fast.pad_token_id,
                      # peaked logits: greedy decoding must not hinge on near-ties, which batch
                      # and kernel differences between two identical requests could flip
                      initializer_range=0.5)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    if nan_logits:
        with torch.no_grad():
            model.model.norm.weight.fill_(float("inf"))
    model.save_pretrained(str(out))
    return Path(out)


if __name__ == "__main__":
    make_test_model(sys.argv[1], "--nan-logits" in sys.argv[2:])
