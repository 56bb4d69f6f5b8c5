"""The public APIs."""
