"""Tool calls that follow a start marker (and, in some syntaxes, end at an end marker): the
splitting shared by `hermes` and `mistral`. A syntax subclasses `MarkedCalls` with its markers.

Text that may be the start of the marker (`<tool_` could become `<tool_call>`) is held back until
the next piece decides. A call body that does not parse as a call stays content. Once a call was
made, blank text between or after calls is dropped.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import ClassVar

from minisgl_core.bounded_json import loads_bounded

from minisgl_gateway.agent.base import ToolCall, ToolDelta, ToolParser, hold, parse_call


class MarkedCalls(ToolParser):
    start: ClassVar[str]  # opens a call (or, with no end marker, the rest of the answer)
    end: ClassVar[str | None] = None  # closes a call; None: the call runs to the end
    # A call body's head written name first (`{"name": "f", "arguments": `): a syntax that sets it
    # streams the name as soon as the head is complete, then the arguments as they come; other
    # calls are emitted once complete.
    head: ClassVar[re.Pattern[str] | None] = None

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._in_call = False
        self._seen_call = False
        self._ws = ""  # blank text after a call, held
        self._head: ToolDelta | None = None  # the call being streamed
        self._args_at = 0  # where its arguments start in _buf
        self._sent = 0  # argument characters sent

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolDelta]]:
        start, end = self.start, self.end
        buf = self._buf + text
        self._buf = ""
        content, out = "", []
        while buf:
            if not self._in_call:
                i = buf.find(start)
                if i < 0:
                    keep = 0 if final else hold(buf, start)
                    content += self._emit(buf[:len(buf) - keep], False, final)
                    self._buf = buf[len(buf) - keep:]
                    break
                content += self._emit(buf[:i], True, final)
                buf = buf[i + len(start):]
                self._in_call = True
            j = buf.find(end) if end else -1
            if j < 0:
                if final:  # unclosed: a call if it parses, else the text stays content
                    deltas = self._close(buf)
                    if deltas is None:
                        content += self._emit(start + buf, False, final)
                    out += deltas or []
                else:
                    self._buf = buf
                    if end:
                        out += self._stream_args(buf, end)
                buf = ""
                break
            deltas = self._close(buf[:j])
            if deltas is None:  # not a call after all
                content += self._emit(start + buf[:j + len(end or "")], False, final)
            out += deltas or []
            buf = buf[j + len(end or ""):]
            self._in_call = False
        return content, out

    def _stream_args(self, body: str, end: str) -> list[ToolDelta]:
        """Inside a call: the name once the head is complete, then the arguments so far, less
        what may still be the object's closing brace, blanks or the end marker."""
        out = []
        if self._head is None:
            if not self._open(body):
                return []
            assert self._head is not None
            out.append(self._head)
        safe = body[: len(body) - hold(body, end)][self._args_at:].rstrip(" \t\r\n}")
        if len(safe) > self._sent:
            out.append(ToolDelta(self._head.index, arguments=safe[self._sent:]))
            self._sent = len(safe)
        return out

    def _open(self, body: str) -> bool:
        """Starts the streamed call if `body` begins with a complete name-first head."""
        m = self.head.match(body) if self.head is not None else None
        if m is None or m.end() == len(body):  # more blanks may follow: not yet
            return False
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return False
        self._head = ToolDelta(self.calls, "call_" + secrets.token_hex(12), name)
        self._args_at, self._sent = m.end(), 0
        self.calls += 1
        self._seen_call = True
        return True

    def _close(self, body: str) -> list[ToolDelta] | None:
        """The call's body is complete: its remaining deltas (None: not a call)."""
        head_delta: list[ToolDelta] = []
        if self._head is None and self._open(body) and self._head is not None:
            head_delta = [self._head]
        head, self._head = self._head, None
        if head is not None:
            rest = body[self._args_at:].rstrip()
            rest = rest[:-1].rstrip() if rest.endswith("}") else rest  # the object's close
            return [*head_delta, ToolDelta(head.index, arguments=rest[self._sent:])]
        calls = self._body(body)
        if not calls:
            return None
        self._seen_call = True
        return self.whole_calls(calls)

    def _emit(self, seg: str, before_call: bool, final: bool) -> str:
        """Content text; once a call was made, blank text between or after calls is dropped
        (held while it is not yet known whether text follows)."""
        if not self._seen_call:
            return seg
        text = self._ws + seg
        if text.strip():
            self._ws = ""
            return text
        self._ws = "" if before_call or final else text
        return ""

    def _body(self, body: str) -> list[ToolCall]:
        try:
            obj = loads_bounded(body)
        except ValueError:
            return []
        items = obj if isinstance(obj, list) else [obj]
        parsed = [parse_call(o, self.args_key) for o in items]
        return [c for c in parsed if c is not None]
