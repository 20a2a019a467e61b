"""The run's components the recipe drives: admission and staleness, held-out evaluation."""
