"""Reasoning written between `<think>` and `</think>`: what both reasoning syntaxes share."""

from __future__ import annotations

from typing import ClassVar

from minisgl_gateway.agent.base import hold

OPEN, CLOSE = "<think>", "</think>"


class ThinkTags:
    """Feeds text, returns (reasoning, content) deltas. Text that may be the start of a tag
    (`<thi`) is held back until the next piece decides."""

    starts_in_reasoning: ClassVar[bool] = False  # the prompt already opened <think>

    def __init__(self) -> None:
        inside = self.starts_in_reasoning
        self.state = "reason" if inside else "start"  # start | reason | content
        self.entered = inside
        self._buf = ""
        self._strip = False

    @property
    def reasoning(self) -> bool:
        return self.state == "reason"

    @property
    def pending(self) -> bool:
        """Text held back, or blank lines after </think> still to drop."""
        return bool(self._buf) or self._strip

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        buf = self._buf + text
        self._buf = ""
        reasoning = ""
        if self.state == "start":
            stripped = buf.lstrip()
            if stripped.startswith(OPEN):
                buf = stripped[len(OPEN):]
                self.state = "reason"
                self.entered = True
            elif not final and OPEN.startswith(stripped):
                self._buf = buf  # too early to tell
                return "", ""
            else:
                self.state = "content"
        if self.state == "reason":
            end = buf.find(CLOSE)
            if end >= 0:
                reasoning = buf[:end]
                buf = buf[end + len(CLOSE):]
                self.state = "content"
                self._strip = True
            else:
                keep = 0 if final else hold(buf, CLOSE)
                reasoning, self._buf = buf[:len(buf) - keep], buf[len(buf) - keep:]
                return reasoning, ""
        if self._strip:  # the blank lines after </think> belong to neither part
            buf = buf.lstrip("\n")
            self._strip = not buf
        return reasoning, buf
