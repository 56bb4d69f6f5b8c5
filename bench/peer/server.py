"""vLLM's OpenAI-compatible server as a subprocess: its command line (from the same keyword
arguments as the in-process peer), its environment, start-up until /health answers, and stop.

No tokenizer is carried, so it runs with --skip-tokenizer-init: prompts are token ids and the
completions stream carries the generated ids (`return_token_ids`, which bench.common.stream_clients
sends) with empty text.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from bench.peer.vllm_env import child_env

MODULE = "vllm.entrypoints.openai.api_server"


def flags(kwargs: dict[str, Any]) -> list[str]:
    """EngineArgs keyword arguments as vLLM CLI flags (booleans are BooleanOptionalAction there;
    config dicts such as attention_config take JSON)."""
    out: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def server_command(engine_kwargs: dict[str, Any], port: int,
                   python: str = sys.executable) -> list[str]:
    return [python, "-m", MODULE, "--host", "127.0.0.1", "--port", str(port),
            "--disable-uvicorn-access-log", *flags(engine_kwargs)]


@dataclass
class Server:
    command: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: BinaryIO | None = field(default=None, repr=False)

    @classmethod
    def for_site(cls, site: Path, engine_kwargs: dict[str, Any], port: int,
                 log_path: Path) -> Server:
        return cls(server_command(engine_kwargs, port), child_env(site), log_path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.command[self.command.index('--port') + 1]}"

    def start(self, timeout: float) -> Server:
        """Starts it in its own process group (the engine core and TP workers are its children)
        and waits until GET /health answers 200; exits with the log's tail if it dies first."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise SystemExit(f"bench.peer: the vLLM server exited ({self.proc.returncode}) "
                                 f"during start-up; its log {self.log_path} ends:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise SystemExit(f"bench.peer: the vLLM server was not healthy after {timeout:.0f} s; "
                         f"its log {self.log_path} ends:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        if self._log is not None:
            self._log.close()
            self._log = None
