"""Rollout execution: the agent's program run once per attempt, through lgt-proxy (local processes, a fork
server, Kubernetes Jobs), and the prompt resources delivered to it."""
