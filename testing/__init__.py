"""Test doubles and helpers that tests and benchmarks import: a fake vLLM upstream, the harness binaries'
definitions and their scripted policy, a fake Kubernetes API server, a scripted critic."""
