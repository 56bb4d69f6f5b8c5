"""Helpers shared by the benchmarks and tests: model dirs, roofline, clients, GPU timing, plots."""
