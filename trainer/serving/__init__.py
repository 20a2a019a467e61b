"""The policy being served: the vLLM engine as a managed process (weights pushed in place), and the
trainer's side of lgt-proxy."""
