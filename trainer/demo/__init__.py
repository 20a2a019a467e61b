"""The demo's model factory and toy tasks: a tiny tokenizer and model, an SFT warm start, arith/carry/calc
tasks."""
