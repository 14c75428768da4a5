"""Pieces of the time-to-target benchmark (``benchmarks/time_to_target.py``): the task mix,
validation curves and crossings, the critical-batch fit, ratios and the result cache."""
