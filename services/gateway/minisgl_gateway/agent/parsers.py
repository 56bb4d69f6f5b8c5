"""Reasoning and tool-call parsers: the detokenized text of one choice, split into
`reasoning_content`, `content` and `tool_calls`, incrementally (a stream) or whole.

They live in the gateway: the OpenAI protocol is the gateway's, and they work on the text the
detokenizer already produced (stop strings applied), one parser state per choice.

Streams hold back text that may be the start of a marker (`<thi` could become `<think>`) until the
next delta decides. A hermes call written name first streams its name as soon as the head is
complete, then its arguments as they come; other calls are emitted once complete (a name delta,
then one arguments delta). Text that does not parse as a call stays content.

Tool-call syntaxes:  hermes  <tool_call>{"name": .., "arguments": {..}}</tool_call> (Qwen2.5/3)
                     llama3  {"name": .., "parameters": {..}} as the whole answer (Llama 3.x JSON;
                             an optional <|python_tag|> first)
                     mistral [TOOL_CALLS][{"name": .., "arguments": {..}}, ..]
Reasoning syntax:    qwen3   <think>..</think> (also when <think> was in the prompt and only
                             </think> is generated: deepseek_r1)
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

TOOL_PARSERS = ("hermes", "llama3", "mistral")
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def default_parsers(model_name: str) -> tuple[str, str]:
    """(tool parser, reasoning parser) for a model name; "" = none."""
    name = model_name.lower()
    if "llama" in name:
        return "llama3", ""
    if "mistral" in name or "mixtral" in name:
        return "mistral", ""
    return "hermes", "qwen3"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))


def _hold(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """Feeds text, returns (reasoning, content) deltas."""

    def __init__(self, start_in_reasoning: bool = False) -> None:
        self.state = "reason" if start_in_reasoning else "start"  # start | reason | content
        self.entered = start_in_reasoning  # reasoning was seen
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
            if stripped.startswith("<think>"):
                buf = stripped[len("<think>"):]
                self.state = "reason"
                self.entered = True
            elif not final and "<think>".startswith(stripped):
                self._buf = buf  # too early to tell
                return "", ""
            else:
                self.state = "content"
        if self.state == "reason":
            end = buf.find("</think>")
            if end >= 0:
                reasoning = buf[:end]
                buf = buf[end + len("</think>"):]
                self.state = "content"
                self._strip = True
            else:
                keep = 0 if final else _hold(buf, "</think>")
                reasoning, self._buf = buf[:len(buf) - keep], buf[len(buf) - keep:]
                return reasoning, ""
        if self._strip:  # the blank lines after </think> belong to neither part
            buf = buf.lstrip("\n")
            self._strip = not buf
        return reasoning, buf


def _parse_call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


@dataclass(slots=True)
class ToolDelta:
    """A piece of the choice's call number `index`: the first carries id and name, the rest
    argument fragments (concatenated, they are the call's arguments JSON)."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


def assemble(deltas: list[ToolDelta]) -> list[ToolCall]:
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        call = calls.get(d.index)
        if call is None:
            call = calls[d.index] = ToolCall(d.name, "", d.id)
        call.arguments += d.arguments
    return [calls[k] for k in sorted(calls)]


# The head of a hermes call written name-first: its arguments can stream as they are generated.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class ToolCallSplitter:
    """Feeds content text, returns (content delta, tool-call deltas)."""

    def __init__(self, syntax: str) -> None:
        self.syntax = syntax
        self._buf = ""
        self._in_call = False
        self._seen_call = False
        self._ws = ""  # blank text after a call, held
        self._mode = "start"  # llama3: start | call (the answer opened with "{") | text
        self.calls = 0
        self._head: ToolDelta | None = None  # the call being streamed (hermes)
        self._args_at = 0  # where its arguments start in _buf
        self._sent = 0  # argument characters sent

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolDelta]]:
        if self.syntax == "llama3":
            content, calls = self._feed_llama(text, final)
            return content, self._whole_calls(calls)
        start, end = ("<tool_call>", "</tool_call>") if self.syntax == "hermes" \
            else ("[TOOL_CALLS]", None)
        buf = self._buf + text
        self._buf = ""
        content, out = "", []
        while buf:
            if not self._in_call:
                i = buf.find(start)
                if i < 0:
                    keep = 0 if final else _hold(buf, start)
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
        """Hermes, inside a call: the name once the head is complete, then the arguments so
        far, less what may still be the object's closing brace, blanks or the end marker."""
        out = []
        if self._head is None:
            if not self._open(body):
                return []
            assert self._head is not None
            out.append(self._head)
        safe = body[: len(body) - _hold(body, end)][self._args_at:].rstrip(" \t\r\n}")
        if len(safe) > self._sent:
            out.append(ToolDelta(self._head.index, arguments=safe[self._sent:]))
            self._sent = len(safe)
        return out

    def _open(self, body: str) -> bool:
        """Starts the streamed call if `body` begins with a complete name-first head."""
        m = _HEAD.match(body) if self.syntax == "hermes" else None
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
        return self._whole_calls(calls)

    def _whole_calls(self, calls: list[ToolCall]) -> list[ToolDelta]:
        out = []
        for call in calls:
            out.append(ToolDelta(self.calls, call.id, call.name))
            out.append(ToolDelta(self.calls, arguments=call.arguments))
            self.calls += 1
        return out

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
            obj = json.loads(body)
        except ValueError:
            return []
        items = obj if isinstance(obj, list) else [obj]
        parsed = [_parse_call(o, "arguments") for o in items]
        return [c for c in parsed if c is not None]

    def _feed_llama(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        self._buf += text
        if self._mode == "text":
            out, self._buf = self._buf, ""
            return out, []
        head = self._buf.strip()
        body = head.removeprefix("<|python_tag|>").lstrip()
        if self._mode == "start":
            undecided = not body or "<|python_tag|>".startswith(head)
            if undecided and not final:
                return "", []
            self._mode = "call" if body.startswith("{") else "text"
            if self._mode == "text":
                out, self._buf = self._buf, ""
                return out, []
        if not final:
            return "", []
        try:
            call = _parse_call(json.loads(body), "parameters")
        except ValueError:
            call = None
        out, self._buf = ("", "") if call else (self._buf, "")
        return out, [call] if call else []


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tools: list[ToolDelta] = field(default_factory=list)

    @property
    def calls(self) -> list[ToolCall]:
        """Whole calls (a unary answer feeds all its text at once)."""
        return assemble(self.tools)


class ChoiceParser:
    """Both parsers for one choice; `tool_syntax` / `reasoning_syntax` "" turn one off."""

    def __init__(self, tool_syntax: str, reasoning_syntax: str) -> None:
        self.reason = ReasoningSplitter(reasoning_syntax == "deepseek_r1") \
            if reasoning_syntax else None
        self.tools = ToolCallSplitter(tool_syntax) if tool_syntax else None
        self.reasoning_tokens = 0
        self._undecided_tokens = 0

    def feed(self, text: str, num_tokens: int = 0, final: bool = False) -> Delta:
        reasoning, content = "", text
        r = self.reason
        if r is not None:
            before = r.state
            reasoning, content = r.feed(text, final)
            if before == "content":
                pass
            elif r.entered:  # a chunk that reasoned (the one with </think> included)
                self.reasoning_tokens += self._undecided_tokens + num_tokens
                self._undecided_tokens = 0
            elif r.state == "start":
                self._undecided_tokens += num_tokens  # maybe the first pieces of <think>
        tools: list[ToolDelta] = []
        if self.tools is not None and (content or final):
            content, tools = self.tools.feed(content, final)
        return Delta(reasoning, content, tools)

    @property
    def passthrough(self) -> bool:
        """From here on text passes unchanged (reasoning over or never started, no tool
        parser): streams may take their plain-text fast path again."""
        r = self.reason
        return self.tools is None and (r is None or (r.state == "content" and not r.pending))

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.calls > 0
