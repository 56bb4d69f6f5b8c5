"""Agent."""
