"""Micro-benchmarks: one kernel or one service in isolation (python -m bench.micro.<name>)."""
