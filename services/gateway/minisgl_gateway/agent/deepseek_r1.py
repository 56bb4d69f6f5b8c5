"""Reasoning syntax `deepseek_r1`: the chat template already wrote `<think>` into the prompt, so
the answer starts inside the reasoning and only `</think>` is generated."""

from __future__ import annotations

from minisgl_gateway.agent.think_tags import ThinkTags


class DeepSeekR1Reasoning(ThinkTags):
    starts_in_reasoning = True
