"""Automatic prompt optimisation: prompt resources rewritten from traces and rewards (``optimize``);
``command``, ``lgt-train apo``'s work, serves the policy for it."""
