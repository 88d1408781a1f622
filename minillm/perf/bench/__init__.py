"""Benchmarks (not tests): side by side in one run, roofline units, JSON with the machine."""
