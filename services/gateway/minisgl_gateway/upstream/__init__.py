"""Upstream."""
