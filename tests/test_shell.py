"""`minisgl shell` in a real terminal (a pty): streamed answers, history, /reset, /exit."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
PROMPT = ">>> "


class Terminal:
    """A child process on a pseudo-terminal, read like a person would see it."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = pty.openpty()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "apps" / "minisgl"), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     cwd=ROOT, start_new_session=True)
        os.close(slave)
        self.seen = ""  # everything shown so far
        self._pos = 0

    def read_until(self, marker: str, timeout: float = 120.0) -> str:
        """Output since the last call, up to and including `marker`."""
        deadline = time.monotonic() + timeout
        while marker not in self.seen[self._pos:]:
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} on the terminal; it shows:\n{self.seen[-2000:]}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    data = os.read(self.master, 4096)
                except OSError:  # the child closed the terminal
                    data = b""
                if not data:
                    assert marker in self.seen[self._pos:], self.seen[-2000:]
                    break
                self.seen += data.decode("utf-8", "replace").replace("\r\n", "\n")
        end = self.seen.index(marker, self._pos) + len(marker)
        out, self._pos = self.seen[self._pos:end], end
        return out

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> int:
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            os.close(self.master)


def expected(target: str, turns: list[tuple[str, str]], question: str) -> str:
    messages = [common_pb2.ChatMessage(role=r, content=c) for u, a in turns
                for r, c in (("user", u), ("assistant", a))]
    messages.append(common_pb2.ChatMessage(role="user", content=question))
    with grpc.insecure_channel(target) as channel:
        reply = generation_pb2_grpc.GenerationStub(channel).Chat(generation_pb2.ChatRequest(
            messages=messages, sampling=common_pb2.SamplingParams(
                temperature=0, top_p=1.0, max_tokens=12)), timeout=120)
    return reply.choices[0].text


def answer_of(shown: str, question: str) -> str:
    """What the shell printed after the echoed question and before the next prompt."""
    return shown.split(question + "\n", 1)[1].rsplit(PROMPT, 1)[0].strip()


def shell(*args: str) -> Terminal:
    return Terminal([sys.executable, "-m", "minisgl.shell", "--temperature", "0",
                     "--max-tokens", "12", *args])


def test_shell_chats_keeps_history_and_resets(stack) -> None:
    target = stack.grpc_target
    term = shell("--target", target)
    try:
        term.read_until(PROMPT)
        first_q, second_q = "Who made the heaven?", "And what else?"
        first = expected(target, [], first_q)
        term.type(first_q)
        shown = term.read_until(PROMPT)
        assert first and answer_of(shown, first_q) == first.strip(), shown
        second = expected(target, [(first_q, first)], second_q)
        term.type(second_q)
        shown = term.read_until(PROMPT)
        assert answer_of(shown, second_q) == second.strip(), shown
        term.type("/reset")
        assert "reset" in term.read_until(PROMPT)
        term.type(first_q)  # a fresh conversation answers as the first time
        assert answer_of(term.read_until(PROMPT), first_q) == first.strip()
        term.type("/nonsense")
        assert "unknown command" in term.read_until(PROMPT)
        term.type("/exit")
    finally:
        code = term.close()
    assert code == 0


def test_shell_reports_an_unreachable_gateway() -> None:
    term = Terminal([sys.executable, "-m", "minisgl.shell", "--target", "127.0.0.1:1",
                     "--connect-timeout", "1"])
    try:
        assert "cannot reach" in term.read_until("cannot reach", timeout=60)
    finally:
        assert term.close() == 1


def test_shell_starts_and_stops_a_local_stack(tiny_model_path: Path) -> None:
    term = shell("--model", str(tiny_model_path))
    try:
        term.read_until(PROMPT, timeout=240)
        term.type("In the beginning")
        assert answer_of(term.read_until(PROMPT), "In the beginning")
        term.type("/exit")
    finally:
        code = term.close()
    assert code == 0
