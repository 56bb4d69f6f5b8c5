"""Profilers: where a benchmark run's GPU and host time goes (python -m bench.profile.<name>)."""
