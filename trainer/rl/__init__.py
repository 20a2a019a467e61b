"""The RL math: advantages and loss weights per rollout (no torch), and the loss over token tensors."""
