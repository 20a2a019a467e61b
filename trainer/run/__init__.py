"""The run's components the recipe builds in setup and drives: admission (pure), the group scheduler,
the supervisor of the engine and proxy, the run log, the stop rules, held-out evaluation, the run's
progress; and ``evaluate`` (``lgt-train eval``: one held-out evaluation, the command's work, above the
recipe)."""
