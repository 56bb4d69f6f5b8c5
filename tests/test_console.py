"""Console behaviour shared by every service: log format selection, request ids in log lines,
--version, and a start-up failure as one clear log line (no traceback)."""

from __future__ import annotations

import io
import json
import logging
import socket
import subprocess
import sys

import pytest
from minisgl_core import logging as core_logging
from minisgl_core.config import version
from minisgl_core.flags import ServiceFlags
from minisgl_core.logging import REQUEST_ID, log_fields, resolve_format, setup_logging
from minisgl_core.startup import explain


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_format_is_text_on_a_terminal_and_json_otherwise() -> None:
    assert resolve_format("auto", _Tty()) == "text"
    assert resolve_format("auto", io.StringIO()) == "json"
    assert resolve_format("json", _Tty()) == "json"
    assert resolve_format("text", io.StringIO()) == "text"
    with pytest.raises(ValueError):
        resolve_format("xml", io.StringIO())


def test_log_format_flag_and_env_reach_setup_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_logging, "default_format", "auto")
    ServiceFlags("scheduler", "test", ()).parse(["--log-format", "text"])
    assert core_logging.default_format == "text"
    monkeypatch.setenv("MINISGL_LOG_FORMAT", "json")
    ServiceFlags("scheduler", "test", ()).parse([])
    assert core_logging.default_format == "json"


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_request_id_in_lines_from_context_and_fields(fmt: str, monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("svc", "info", fmt)
        log = logging.getLogger("t")
        token = REQUEST_ID.set("req-ctx")
        log.info("from the context")
        REQUEST_ID.reset(token)
        log.info("from fields", extra=log_fields(request_id="req-field", n=2))
        log.info("about no request")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    if fmt == "json":
        entries = [json.loads(line) for line in lines]
        assert [e.get("request_id") for e in entries] == ["req-ctx", "req-field", None]
        assert entries[1]["n"] == 2 and entries[0]["service"] == "svc"
    else:
        assert "request_id=req-ctx" in lines[0] and "request_id=req-field" in lines[1]
        assert "request_id" not in lines[2] and " svc: " in lines[2]


@pytest.mark.parametrize("module", [["minisgl_scheduler"], ["minisgl_gateway"],
                                    ["minisgl_tokenizer", "tokenizer"],
                                    ["minisgl_tokenizer", "detokenizer"], ["minisgl_worker"],
                                    ["minisgl.cli"]])
def test_version(module: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", *module, "--version"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(" " + version()), out.stdout
    assert out.stdout.startswith("minisgl")


def test_port_in_use_is_one_clear_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "minisgl_scheduler", "--port", str(port), "--metrics-port", "0",
             "--log-format", "json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    entry = json.loads(lines[0])
    assert entry["level"] == "error" and entry["service"] == "scheduler"
    assert f"port {port} is in use" in entry["msg"] and "--port" in entry["msg"]
    assert "Traceback" not in out.stderr and "exc" not in entry


def test_debug_start_up_failure_keeps_the_traceback() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "minisgl_worker", "--model", "/nonexistent/model",
         "--log-format", "json", "--log-level", "debug"], capture_output=True, text=True,
        timeout=120)
    assert out.returncode == 1
    errors = [json.loads(line) for line in out.stderr.splitlines()
              if line.startswith("{") and json.loads(line)["level"] == "error"]
    assert len(errors) == 1
    assert "--model" in errors[0]["msg"] and "Traceback" in errors[0]["exc"]


def test_explain_names_the_fix() -> None:
    assert "--device cpu" in explain(RuntimeError("Found no NVIDIA driver on your system; CUDA "
                                                  "is not available"))
    assert "start the worker" in explain(type("WorkerFailed", (Exception,), {})(
        "worker 127.0.0.1:1 not reachable after 5s"))
    assert "--model" in explain(FileNotFoundError("no config.json in /x"))
    assert "debug" in explain(ValueError("something else"))
