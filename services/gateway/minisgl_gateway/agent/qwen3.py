"""Reasoning syntax `qwen3`: the answer may open with `<think>..</think>` (Qwen3)."""

from __future__ import annotations

from minisgl_gateway.agent.think_tags import ThinkTags


class Qwen3Reasoning(ThinkTags):
    starts_in_reasoning = False
