"""Build a tiny random Qwen2 model with a locally trained byte-level BPE tokenizer (ChatML template).

For tests that need a real vLLM engine: nothing is downloaded. Run with an environment that has
transformers and tokenizers (the engine's): python make_tiny_model.py OUT_DIR [--nan-logits]

``--nan-logits`` sets the final norm's weight to infinity, so every logit is NaN: vLLM then cannot
write a logprob as JSON and answers 400 to any request for logprobs (what it does past a model's
positions on CPU, where the failure depends on memory layout; this one is deterministic).
"""

import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def main(out: str, nan_logits: bool = False) -> None:
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
    fast.save_pretrained(out)
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
    model.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1], "--nan-logits" in sys.argv[2:])
