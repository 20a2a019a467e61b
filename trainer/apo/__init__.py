"""Automatic prompt optimisation: prompt resources rewritten from traces and rewards."""
