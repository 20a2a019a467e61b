"""Small local models for demos, tests and benchmarks, and the toy tasks they learn; nothing is downloaded.

``factory.make_model`` makes (or reuses) a model directory in one call. Each step is its own module,
from the bottom up: ``chat`` (the ChatML template that renders tools, tool calls and tool results the way
vLLM's ``hermes`` tool parser reads them), ``tasks`` (arith, carry, calc and words: problems, dialogues,
fixed errors, rewards), ``tokenizer`` (a byte-level BPE trained on the tasks' text), ``model`` (a randomly
initialised ``Qwen2ForCausalLM`` in a few sizes), ``dialogues`` (token ids and loss masks of the
dialogues), ``evaluation`` (a model's accuracy on its task) and ``warmstart`` (a short supervised warm
start, so that RL has something to amplify).
"""
